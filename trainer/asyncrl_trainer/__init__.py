"""asyncrl's ``torch`` trainer engine.

The learner role (Rust) keeps the NATS contract, batches, weights and
checkpoint bookkeeping; this package computes the step in PyTorch. Its
objective (:mod:`asyncrl_trainer.objective`) is the Rust learner's
(``learner/src/objective.rs``), checked against the vectors the Rust side
writes (``tests/data/objective_vectors.json``).
"""

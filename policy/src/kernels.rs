//! Portable CPU kernels: the same float results on every x86-64 CPU.
//!
//! libtorch picks its CPU kernels by what the CPU offers, in three places:
//! ATen's own vectorised kernels (softmax, log-softmax, reductions; AVX2 or
//! AVX-512), MKL's GEMM (by vendor and instruction set) and oneDNN's JIT
//! kernels (GELU, layer norm). Their results differ in the last bits from
//! one CPU to another, and a long supervised run amplifies those bits: the
//! same `asyncrl warmstart` has made 0.315 and 0.759 held-out accuracy on
//! two machines of one kind. Pinning all three to their baseline code paths
//! makes the results depend on the program and its inputs only, at some
//! cost in speed (docs/benchmarks.md, "The warm start on portable CPU
//! kernels").
//!
//! Each library reads its setting once, at its first use, so the pin must
//! happen before the process runs any tensor operation: [`pin_portable`] is
//! called first thing in `main`.

/// The environment variables that select baseline code paths, and their
/// values.
pub const PORTABLE: [(&str, &str); 3] = [
    // ATen's dispatch: no explicit vector code (what an x86-64 compiler
    // emits for the baseline instruction set).
    ("ATEN_CPU_CAPABILITY", "default"),
    // MKL's conditional numerical reproducibility: the code path it
    // promises gives the same results on every Intel and compatible CPU.
    ("MKL_CBWR", "COMPATIBLE"),
    // oneDNN: SSE4.1 at most, which every x86-64 CPU of the last 15 years
    // has.
    ("ONEDNN_MAX_CPU_ISA", "SSE41"),
];

/// Which CPU kernels this process uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kernels {
    /// [`PORTABLE`] is set: results are the same on every x86-64 CPU.
    Portable,
    /// The fastest kernels this CPU offers (or whatever the environment
    /// selected): results follow the CPU.
    Native,
}

impl Kernels {
    /// The name `warmstart.json` records: `portable` or `native`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kernels::Portable => "portable",
            Kernels::Native => "native",
        }
    }
}

/// Sets [`PORTABLE`] in this process's environment, overriding whatever
/// was there.
///
/// # Safety
/// Must be called while the process has one thread, before any tensor
/// operation (`std::env::set_var`'s contract; and each library reads its
/// setting once).
pub unsafe fn pin_portable() {
    for (name, value) in PORTABLE {
        // SAFETY: the caller guarantees that no other thread reads or
        // writes the environment.
        unsafe { std::env::set_var(name, value) };
    }
}

/// [`Kernels::Portable`] when every variable of [`PORTABLE`] has its value.
pub fn current() -> Kernels {
    let pinned = PORTABLE
        .iter()
        .all(|(name, value)| std::env::var(name).is_ok_and(|v| v == *value));
    if pinned {
        Kernels::Portable
    } else {
        Kernels::Native
    }
}

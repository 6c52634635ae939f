//! Deterministic generators for the built-in tasks.

use asyncrl_text::Prompt;

use crate::TaskItem;

/// SplitMix64: a tiny PRNG whose output is fixed by its definition, so a
/// data set generated from a seed is the same on every machine and with
/// every version of every dependency.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The internal state: `SplitMix64::new(rng.state())` continues exactly
    /// where `rng` is.
    pub fn state(&self) -> u64 {
        self.0
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n.max(1))) >> 64) as u64
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The built-in tasks, each with a verifier in [`crate::score`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BuiltinTask {
    /// `37+58=` → `95`: integer addition and subtraction of numbers below
    /// 100. Reward 1 for the exact answer, else 0.
    Arith,
    /// `rev:31415=` → `51413`: write a digit string back reversed. Lengths
    /// follow a heavy-tailed (discrete Pareto, α = 1.1) distribution from 2
    /// to 64, so a few completions are far longer than the rest: the
    /// workload where asynchronous rollouts pay. Reward = fraction of
    /// positions right.
    Reverse,
    /// `7+x=` → `12`: a sum with one operand hidden, the built-in
    /// multi-turn task (`[environment] url = "builtin:hidden_sum"`). The
    /// model asks `x?`, the environment answers `x=5`, and the model
    /// answers. Operands are drawn from `0..max_operand`; `x` is the answer
    /// less the visible operand, so the task needs no other field. The
    /// final answer is scored like `arith` (its items' verifier).
    HiddenSum,
}

impl BuiltinTask {
    pub fn name(self) -> &'static str {
        match self {
            BuiltinTask::Arith => "arith",
            BuiltinTask::Reverse => "reverse",
            BuiltinTask::HiddenSum => "hidden_sum",
        }
    }

    /// The built-in verifier of this task's items.
    pub fn verifier(self) -> &'static str {
        match self {
            BuiltinTask::Arith | BuiltinTask::HiddenSum => "arith",
            BuiltinTask::Reverse => "reverse",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "arith" => Some(BuiltinTask::Arith),
            "reverse" => Some(BuiltinTask::Reverse),
            "hidden_sum" => Some(BuiltinTask::HiddenSum),
            _ => None,
        }
    }

    /// Every character a prompt or answer of this task can contain.
    pub fn alphabet(self) -> &'static str {
        match self {
            BuiltinTask::Arith => "0123456789+-=",
            BuiltinTask::Reverse => "0123456789rev:=",
            BuiltinTask::HiddenSum => "0123456789+x=?;",
        }
    }
}

/// Longest list of the reverse task.
pub const REVERSE_MAX_LEN: u64 = 64;

fn reverse_len(rng: &mut SplitMix64) -> u64 {
    // Discrete Pareto: floor(x_min / U^(1/α)), x_min = 2, α = 1.1, capped.
    let u = rng.unit().max(1e-12);
    let x = 2.0 / u.powf(1.0 / 1.1);
    (x as u64).clamp(2, REVERSE_MAX_LEN)
}

/// Knobs of the generators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenerateOptions {
    /// `arith`: operands are drawn from `0..max_operand`.
    pub max_operand: u64,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self { max_operand: 100 }
    }
}

/// Generates `n` items of `task` from `seed`; ids are `<task>-<index>`.
pub fn generate(task: BuiltinTask, n: usize, seed: u64) -> Vec<TaskItem> {
    generate_with(task, n, seed, GenerateOptions::default())
}

/// [`generate`] with explicit options.
pub fn generate_with(
    task: BuiltinTask,
    n: usize,
    seed: u64,
    opts: GenerateOptions,
) -> Vec<TaskItem> {
    let bound = opts.max_operand.max(1);
    let mut rng = SplitMix64::new(seed ^ (task as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    (0..n)
        .map(|i| {
            let (prompt, answer) = match task {
                BuiltinTask::Arith => {
                    let a = rng.below(bound) as i64;
                    let b = rng.below(bound) as i64;
                    if rng.below(2) == 0 {
                        (format!("{a}+{b}="), (a + b).to_string())
                    } else {
                        (format!("{a}-{b}="), (a - b).to_string())
                    }
                }
                BuiltinTask::Reverse => {
                    let len = reverse_len(&mut rng);
                    let digits: String = (0..len)
                        .map(|_| char::from(b'0' + rng.below(10) as u8))
                        .collect();
                    (format!("rev:{digits}="), digits.chars().rev().collect())
                }
                BuiltinTask::HiddenSum => {
                    let a = rng.below(bound);
                    let x = rng.below(bound);
                    (format!("{a}+x="), (a + x).to_string())
                }
            };
            TaskItem {
                id: format!("{}-{i:06}", task.name()),
                dataset: task.name().to_owned(),
                prompt: Prompt::Text(prompt),
                answer,
                verifier: task.verifier().to_owned(),
            }
        })
        .collect()
}

/// Every `hidden_sum` problem with operands below `max_operand`, once
/// (`max_operand²` of them, 400 for 20): its held-out set.
pub fn hidden_sum_all(max_operand: u64) -> Vec<TaskItem> {
    let task = BuiltinTask::HiddenSum;
    let mut items = Vec::new();
    for a in 0..max_operand {
        for x in 0..max_operand {
            items.push(TaskItem {
                id: format!("{}-all-{:06}", task.name(), items.len()),
                dataset: task.name().to_owned(),
                prompt: Prompt::Text(format!("{a}+x=")),
                answer: (a + x).to_string(),
                verifier: task.verifier().to_owned(),
            });
        }
    }
    items
}

/// Every `arith` problem with operands below `max_operand`, once:
/// `a+b=` and `a-b=` for each pair, `2·max_operand²` in all (800 for 20):
/// the held-out set that measures the whole task, not a sample of it.
pub fn arith_all(max_operand: u64) -> Vec<TaskItem> {
    let mut items = Vec::new();
    for a in 0..max_operand as i64 {
        for b in 0..max_operand as i64 {
            for (op, answer) in [('+', a + b), ('-', a - b)] {
                items.push(TaskItem {
                    id: format!("arith-all-{:06}", items.len()),
                    dataset: "arith".to_owned(),
                    prompt: Prompt::Text(format!("{a}{op}{b}=")),
                    answer: answer.to_string(),
                    verifier: "arith".to_owned(),
                });
            }
        }
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_are_deterministic_and_seeded() {
        for task in [BuiltinTask::Arith, BuiltinTask::Reverse] {
            assert_eq!(generate(task, 100, 3), generate(task, 100, 3));
            assert_ne!(generate(task, 100, 3), generate(task, 100, 4));
        }
        // Pinned: the definition of SplitMix64 fixes the data set.
        let first = &generate(BuiltinTask::Arith, 1, 0)[0];
        assert_eq!(first.id, "arith-000000");
        let mut rng = SplitMix64::new(1234567);
        assert_eq!(rng.next_u64(), 6457827717110365317);
        let mut copy = SplitMix64::new(rng.state());
        assert_eq!(copy.next_u64(), rng.next_u64());
    }

    #[test]
    fn arith_all_lists_every_problem_once() {
        let all = arith_all(20);
        assert_eq!(all.len(), 800);
        let prompts: std::collections::HashSet<&str> =
            all.iter().map(TaskItem::prompt_text).collect();
        assert_eq!(prompts.len(), 800);
        assert!(prompts.contains("19-19=") && prompts.contains("0+0="));
        let sampled = generate_with(
            BuiltinTask::Arith,
            2000,
            1,
            GenerateOptions { max_operand: 20 },
        );
        assert!(sampled.iter().all(|t| prompts.contains(t.prompt_text())));
        for t in &all {
            assert_eq!(
                crate::score("arith", &t.answer, &t.answer),
                crate::Verdict::Reward(1.0)
            );
        }
    }

    #[test]
    fn hidden_sum_items_hide_one_operand_and_cover_the_task() {
        let all = hidden_sum_all(20);
        assert_eq!(all.len(), 400);
        let prompts: std::collections::HashSet<(&str, &str)> = all
            .iter()
            .map(|t| (t.prompt_text(), t.answer.as_str()))
            .collect();
        assert_eq!(prompts.len(), 400);
        assert!(prompts.contains(&("0+x=", "0")) && prompts.contains(&("19+x=", "38")));
        let sampled = generate_with(
            BuiltinTask::HiddenSum,
            500,
            3,
            GenerateOptions { max_operand: 20 },
        );
        for item in &sampled {
            assert!(prompts.contains(&(item.prompt_text(), item.answer.as_str())));
            assert_eq!(item.verifier, "arith");
            assert!(
                item.prompt_text()
                    .chars()
                    .all(|c| BuiltinTask::HiddenSum.alphabet().contains(c))
            );
        }
        assert_eq!(
            BuiltinTask::from_name(BuiltinTask::HiddenSum.name()),
            Some(BuiltinTask::HiddenSum)
        );
    }

    #[test]
    fn arith_answers_are_right() {
        for item in generate(BuiltinTask::Arith, 500, 1) {
            let p = item.prompt_text().trim_end_matches('=');
            let (a, b, sum) = if let Some((a, b)) = p.split_once('+') {
                (a, b, true)
            } else {
                let (a, b) = p.split_once('-').unwrap();
                (a, b, false)
            };
            let (a, b): (i64, i64) = (a.parse().unwrap(), b.parse().unwrap());
            assert_eq!(item.answer, if sum { a + b } else { a - b }.to_string());
            assert!(
                item.prompt_text()
                    .chars()
                    .all(|c| BuiltinTask::Arith.alphabet().contains(c))
            );
        }
    }

    #[test]
    fn operand_bound_is_respected() {
        for item in generate_with(
            BuiltinTask::Arith,
            300,
            5,
            GenerateOptions { max_operand: 20 },
        ) {
            let ops: Vec<i64> = item
                .prompt_text()
                .trim_end_matches('=')
                .split(['+', '-'])
                .map(|x| x.parse().unwrap())
                .collect();
            assert!(
                ops.iter().all(|o| (0..20).contains(o)),
                "{}",
                item.prompt_text()
            );
        }
        assert_eq!(
            generate(BuiltinTask::Arith, 10, 1),
            generate_with(BuiltinTask::Arith, 10, 1, GenerateOptions::default())
        );
    }

    #[test]
    fn reverse_lengths_are_long_tailed() {
        let items = generate(BuiltinTask::Reverse, 4000, 2);
        let lens: Vec<usize> = items.iter().map(|i| i.answer.len()).collect();
        let mut sorted = lens.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2];
        let p99 = sorted[sorted.len() * 99 / 100];
        assert!(median <= 4, "median {median}");
        assert!(
            p99 >= 8 * median,
            "tail too light: median {median}, p99 {p99}"
        );
        assert!(*sorted.first().unwrap() >= 2 && *sorted.last().unwrap() as u64 <= REVERSE_MAX_LEN);
        for item in &items {
            let digits = item
                .prompt_text()
                .trim_start_matches("rev:")
                .trim_end_matches('=');
            assert_eq!(item.answer, digits.chars().rev().collect::<String>());
        }
    }
}

//! The workload: bench/admission_bench.py's mix, seeded, and the live bench's exact requests.

use super::*;

#[derive(Debug, Clone)]
pub(super) struct Req {
    pub(super) id: u64,
    pub(super) kind: &'static str,
    pub(super) class: &'static str,
    pub(super) prompt: u64,
    pub(super) cap: Option<u64>,
    /// Tokens greedy decoding produces with no cap.
    pub(super) true_len: u64,
}

/// A chat question: prompt tokens with ChatML, its answer's length, and with the fan-out's stop
/// strings ("\n", ".").
pub(super) struct Question(u64, u64, u64);

/// bench/admission_bench.py's QUESTIONS, in order (see the header for where the lengths come from).
pub(super) const QUESTIONS: [Question; 8] = [
    Question(37, 7, 7),       // What is the capital of France?
    Question(34, 137, 2),     // Name three colours.
    Question(38, 11, 11),     // What is 2 + 2?
    Question(35, 1000, 1000), // Say hello in Spanish. (ran to a 900-token cap, stops or not)
    Question(36, 53, 9),      // What colour is the sky?
    Question(34, 9, 9),       // Name a fruit.
    Question(36, 1000, 22),   // What is the largest planet? (ran to a 900-token cap)
    Question(38, 154, 13),    // How many legs does a spider have?
];

pub(super) struct Kind {
    pub(super) name: &'static str,
    pub(super) weight: u64,
    pub(super) class: &'static str,
}

#[rustfmt::skip]
pub(super) const KINDS: [Kind; 8] = [
    kind("short prompt, big cap", 5, "batch"),
    kind("short prompt, big cap (strict)", 3, "standard"),
    kind("unset cap", 2, "standard"),
    kind("chat", 4, "interactive"),
    kind("vip chat", 1, "vip"),
    kind("long prompt, small cap", 3, "interactive"),
    kind("counting, to its cap", 2, "batch"),
    kind("long story", 1, "standard"),
];

pub(super) const fn kind(name: &'static str, weight: u64, class: &'static str) -> Kind {
    Kind {
        name,
        weight,
        class,
    }
}

pub(super) const FALLBACK_KIND: Kind = kind("long story", 1, "standard");

pub(super) fn question(rng: &mut Rng) -> &'static Question {
    QUESTIONS
        .get(rng.index(QUESTIONS.len()))
        .unwrap_or(&Question(37, 7, 7))
}

pub(super) fn make_request(kind: usize, rng: &mut Rng, context: u64, id: u64) -> Req {
    let k = KINDS.get(kind).unwrap_or(&FALLBACK_KIND);
    let big = |rng: &mut Rng| rng.range(context * 2 / 5, context * 3 / 4);
    let (prompt, cap, true_len) = match kind {
        0 | 1 => {
            let q = question(rng);
            (q.0, Some(big(rng)), q.1)
        }
        2 => {
            let q = question(rng);
            (q.0, None, q.1)
        }
        3 | 4 => {
            let q = question(rng);
            (q.0, Some(128), q.1)
        }
        5 => (30 * rng.range(8, 14) + 37, Some(40), TO_CAP),
        6 => (11, Some(rng.range(100, 200)), TO_CAP),
        _ => (42, Some(rng.range(150, 250)), TO_CAP),
    };
    Req {
        id,
        kind: k.name,
        class: k.class,
        prompt,
        cap,
        true_len,
    }
}

/// The mix of bench/admission_bench.py's `make_workload`: jobs of one request, or a fan-out burst.
pub(super) fn make_workload(seed: u64, jobs: usize, context: u64) -> Vec<Vec<Req>> {
    let mut rng = Rng(seed);
    let n_fan = (jobs / 12).max(1);
    let fanouts: Vec<usize> = (0..n_fan)
        .map(|i| (jobs as f64 * (i as f64 + 0.5) / n_fan as f64) as usize)
        .collect();
    let over_at = (jobs / 3..jobs).find(|j| !fanouts.contains(j));
    let mut deck: Vec<usize> = (0..KINDS.len()).collect();
    for i in (1..deck.len()).rev() {
        let j = rng.index(i + 1);
        deck.swap(i, j);
    }
    let mut deck: VecDeque<usize> = deck.into();
    let total_weight: u64 = KINDS.iter().map(|k| k.weight).sum();
    let mut out = Vec::with_capacity(jobs);
    let mut id = 0u64;
    for j in 0..jobs {
        if fanouts.contains(&j) {
            let k = rng.range(10, 20);
            let job = (0..k)
                .map(|_| {
                    id += 1;
                    let q = question(&mut rng);
                    Req {
                        id,
                        kind: "agent fan-out branch",
                        class: "batch",
                        prompt: q.0,
                        cap: Some(rng.range(200, 400)),
                        true_len: q.2,
                    }
                })
                .collect();
            out.push(job);
        } else if Some(j) == over_at {
            id += 1;
            out.push(vec![Req {
                id,
                kind: "prompt over the context",
                class: "standard",
                prompt: context + 64,
                cap: Some(16),
                true_len: 16,
            }]);
        } else {
            let kind = deck.pop_front().unwrap_or_else(|| {
                let mut x = rng.range(1, total_weight);
                KINDS
                    .iter()
                    .position(|k| {
                        if x <= k.weight {
                            true
                        } else {
                            x -= k.weight;
                            false
                        }
                    })
                    .unwrap_or(0)
            });
            id += 1;
            out.push(vec![make_request(kind, &mut rng, context, id)]);
        }
    }
    out
}

/// The live bench's 25 requests at seed 11, 12 jobs, 640 tokens of context: (job, kind, class,
/// prompt tokens, cap, tokens it produced greedily).
pub(super) type LiveRow = (usize, &'static str, &'static str, u64, Option<u64>, u64);

#[rustfmt::skip]
pub(super) const LIVE_SEED11_640: [LiveRow; 25] = [
    (0, "long story", "standard", 42, Some(230), 230),
    (1, "counting, to its cap", "batch", 11, Some(178), 178),
    (2, "vip chat", "vip", 38, Some(128), 11),
    (3, "chat", "interactive", 34, Some(128), 128),
    (4, "prompt over the context", "standard", 704, Some(16), 16),
    (5, "long prompt, small cap", "interactive", 367, Some(40), 40),
    (6, "agent fan-out branch", "batch", 38, Some(223), 11),
    (6, "agent fan-out branch", "batch", 37, Some(352), 7),
    (6, "agent fan-out branch", "batch", 36, Some(315), 22),
    (6, "agent fan-out branch", "batch", 38, Some(359), 11),
    (6, "agent fan-out branch", "batch", 37, Some(335), 7),
    (6, "agent fan-out branch", "batch", 34, Some(215), 2),
    (6, "agent fan-out branch", "batch", 37, Some(248), 7),
    (6, "agent fan-out branch", "batch", 35, Some(353), 353),
    (6, "agent fan-out branch", "batch", 37, Some(399), 7),
    (6, "agent fan-out branch", "batch", 38, Some(283), 13),
    (6, "agent fan-out branch", "batch", 38, Some(351), 13),
    (6, "agent fan-out branch", "batch", 35, Some(332), 332),
    (6, "agent fan-out branch", "batch", 35, Some(363), 363),
    (6, "agent fan-out branch", "batch", 36, Some(327), 9),
    (7, "unset cap", "standard", 37, None, 7),
    (8, "short prompt, big cap", "batch", 34, Some(373), 137),
    (9, "short prompt, big cap (strict)", "standard", 36, Some(360), 53),
    (10, "long story", "standard", 42, Some(240), 240),
    (11, "short prompt, big cap (strict)", "standard", 35, Some(387), 387),
];

pub(super) fn live_workload() -> Vec<Vec<Req>> {
    let mut out: Vec<Vec<Req>> = Vec::new();
    for (i, (job, kind, class, prompt, cap, len)) in LIVE_SEED11_640.iter().enumerate() {
        while out.len() <= *job {
            out.push(Vec::new());
        }
        // An output that ended at its cap in the oracle pass would have run on.
        let true_len = if Some(*len) == *cap { TO_CAP } else { *len };
        if let Some(j) = out.get_mut(*job) {
            j.push(Req {
                id: i as u64 + 1,
                kind,
                class,
                prompt: *prompt,
                cap: *cap,
                true_len,
            });
        }
    }
    out
}

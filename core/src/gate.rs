//! One admission, end to end and pure: price a parsed request, then decide against the ledger
//! under the request's class policy. The filter runs `decide` inside `store::transact`, so the
//! decision and the reservation are one CAS transition.

use crate::cap::{largest_cap_that_fits, price_request, prompt_over_context, Price};
use crate::config::Config;
use crate::error::{ApiError, ErrorKind};
use crate::ledger::{AdmitOutcome, AdmitRequest, Lease, Ledger, RejectReason};
use crate::policy::{Action, ClassPolicy};
use crate::request::{Input, ParsedRequest, PromptItem};
use crate::tokenize::{padded_count, TokenCounter};

/// A request priced and ready for the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Priced {
    pub prompt_tokens: Vec<u64>,
    pub choices: u64,
    /// At the worst case: every sequence reaching its cap.
    pub price: Price,
    /// For an elastic class whose allowance is below the cap: what the lease reserves instead.
    pub elastic: Option<ElasticPrice>,
    /// The chat's prefix before its last message, which other requests may share.
    pub prefix: Option<SharedPrefix>,
}

/// A chat's messages before its last one (agents of one swarm send the same system prompt and
/// tools and differ in their last message): a backend with prefix caching holds its KV blocks
/// once for every live request that starts with it, so the ledger charges it once
/// ([`Ledger::prefix_credit`]). `bytes` is the KV of its tokens: the chat's count less its last
/// message's and one [`PREFIX_GRAIN`] for the template's tokens around it, rounded down to a
/// multiple of the grain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedPrefix {
    pub key: u64,
    pub bytes: u64,
}

/// Prefix tokens are counted in steps of at least this many: the backend's block (its scratch
/// margin per reservation) when larger.
pub const PREFIX_GRAIN: u64 = 16;

/// Shorter shared prefixes are not worth tracking.
pub const MIN_PREFIX_TOKENS: u64 = 4 * PREFIX_GRAIN;

/// An elastic reservation: each sequence's output is reserved up to `output_tokens` (below the
/// cap, which the request keeps), for `bytes` in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElasticPrice {
    pub output_tokens: u64,
    pub bytes: u64,
}

impl Priced {
    /// What of its price a live lease in `ledger` pays for it: its shared prefix, if paid there.
    pub fn credit_in(&self, ledger: &Ledger) -> u64 {
        self.prefix
            .map_or(0, |p| ledger.prefix_credit(p.key, p.bytes))
    }

    /// What the lease reserves: the elastic price when there is one, else the worst case.
    pub fn reserve_bytes(&self) -> u64 {
        self.elastic.map_or(self.price.bytes, |e| e.bytes)
    }

    /// Reserve `allowance` output tokens per sequence instead of the whole cap (an elastic
    /// class). Nothing changes when the allowance is not below the cap.
    pub fn with_allowance(mut self, cfg: &Config, allowance: u64) -> Priced {
        let cap = self.price.cap.cap;
        self.elastic = (allowance < cap)
            .then(|| {
                price_request(
                    &cfg.pricing,
                    &self.prompt_tokens,
                    Some(allowance),
                    self.choices,
                )
            })
            .and_then(Result::ok)
            .filter(|p| p.bytes < self.price.bytes)
            .map(|p| ElasticPrice {
                output_tokens: p.cap.cap,
                bytes: p.bytes,
            });
        self
    }
}

/// What a refusal over the context adds when text was counted by an approximation.
pub const APPROXIMATE_COUNT: &str = "This gateway counts text with an approximation of the \
    model's tokenizer, padded, which may differ from the model's own count.";

/// And for a completions request, which may send its prompt as token ids instead.
pub const TOKEN_IDS_EXACT: &str = "A prompt sent as token ids is counted exactly.";

/// Count and price a request. Errors are final (400/413) and reserve nothing.
pub fn price(
    cfg: &Config,
    counter: &TokenCounter,
    req: &ParsedRequest,
) -> Result<Priced, ApiError> {
    // Count no further than the context: past it the request is refused whatever its length, and
    // counting a multi-megabyte prompt to the end would stall the worker. A count within the
    // context is padded below and may still reach it (refused with the padded count).
    let context = cfg.pricing.spec.context_tokens;
    // Text counted by a tokenizer that is not the model's own: a refusal says so.
    let approximate = cfg.token_multiplier > 1.0
        && match &req.input {
            Input::Prompts(items) => items.iter().any(|i| matches!(i, PromptItem::Text(_))),
            Input::Chat(_) => true,
        };
    let over_context = |e: ApiError| {
        let e = e
            .with_status(cfg.context_error_status)
            .with_param(req.prompt_field());
        if !approximate {
            return e;
        }
        let ids = match &req.input {
            Input::Prompts(_) => format!(" {TOKEN_IDS_EXACT}"),
            Input::Chat(_) => String::new(),
        };
        ApiError {
            message: format!("{} {APPROXIMATE_COUNT}{ids}", e.message),
            ..e
        }
    };
    let mut prompt_tokens = counter
        .count_input_capped(&req.input, context)
        .map_err(|_| over_context(prompt_over_context(req.requested_cap(), context)))?;
    if cfg.token_multiplier > 1.0 {
        // A fallback tokenizer only approximates the model's: pad text counts, and with
        // `tokenizer.pad_runs` the runs it merges, never below the pieces the model's
        // pre-tokenizer cuts (`padded_count`; token arrays are exact and stay as they are).
        let (m, runs) = (cfg.token_multiplier, cfg.pad_runs);
        match &req.input {
            Input::Prompts(items) => {
                for (t, item) in prompt_tokens.iter_mut().zip(items) {
                    if let PromptItem::Text(text) = item {
                        *t = padded_count(*t, m, runs, [text.as_str()]);
                    }
                }
            }
            Input::Chat(messages) => {
                let texts = messages
                    .iter()
                    .flat_map(|m| [m.role.as_str(), m.content.as_str(), m.extra.as_str()]);
                if let Some(t) = prompt_tokens.first_mut() {
                    *t = padded_count(*t, m, runs, texts);
                }
            }
        }
    }
    let choices = req.choices();
    let mut price = price_request(&cfg.pricing, &prompt_tokens, req.requested_cap(), choices)
        .map_err(|e| match e.kind {
            ErrorKind::ContextLengthExceeded => over_context(e),
            _ => e,
        })?;
    // Priced from the backend's descriptor, the count is the backend's own: the written cap
    // fits, and it also bounds an endpoint serving a longer context than the one priced (the
    // padded fallback, for the requests before the descriptor comes, only approximates that
    // count and may fall short of it). Left out only with an inline model.
    price.cap_from_context &= !cfg.from_backend;
    let prefix = match &req.input {
        Input::Chat(messages) if cfg.share_prefixes && choices == 1 => {
            let counted = prompt_tokens.first().copied().unwrap_or(0);
            shared_prefix(cfg, counter, messages, counted)
        }
        _ => None,
    };
    Ok(Priced {
        prompt_tokens,
        choices,
        price,
        elastic: None,
        prefix,
    })
}

/// The shareable prefix of a chat: its messages before the last one, counted exactly (not by
/// an approximation, which may count more than the backend shares). Not counted again: the
/// chat's count less what its last message can add (its role, content and other fields, and a
/// block for the template's tokens around it and the generation prompt), so pricing a swarm's
/// chat costs one count of its last message more.
fn shared_prefix(
    cfg: &Config,
    counter: &TokenCounter,
    messages: &[crate::request::ChatMessage],
    counted: u64,
) -> Option<SharedPrefix> {
    let (last, before) = messages.split_last()?;
    if before.is_empty() || cfg.token_multiplier > 1.0 {
        return None;
    }
    // Counted no further than the whole chat (a huge last message leaves no prefix).
    let last_tokens = [&last.role, &last.content, &last.extra]
        .iter()
        .map(|t| match counter.count_text_capped(t, counted) {
            crate::tokenize::Capped::Within(n) => n,
            crate::tokenize::Capped::Over => counted,
        })
        .fold(PREFIX_GRAIN, u64::saturating_add);
    // In the backend's blocks (its scratch margin is one block), never finer than the grain.
    let per_token = cfg.pricing.spec.kv_bytes_per_token()?.max(1);
    let grain = (cfg.pricing.scratch_margin_bytes / per_token).max(PREFIX_GRAIN);
    let tokens = counted.saturating_sub(last_tokens) / grain * grain;
    if tokens < MIN_PREFIX_TOKENS {
        return None;
    }
    // SipHash keyed with the backend's admission secret (every worker has it; a client does
    // not), every field length-prefixed: two chats a client made to collide would share a
    // charge the backend holds twice (caught as drift at the next report only). Without a
    // secret, SipHash's fixed keys: collisions cost a birthday search, not FNV's algebra.
    use std::hash::Hasher;
    let secret = cfg.backend.as_ref().map_or("", |b| b.secret.as_str());
    let mut kdf = crate::spec::Fnv1a::new();
    kdf.write(secret.as_bytes());
    let k0 = kdf.finish();
    kdf.write(secret.as_bytes());
    #[allow(deprecated)] // SipHash-2-4 with chosen keys; std has no other keyed hasher.
    let mut h = std::hash::SipHasher::new_with_keys(k0, kdf.finish());
    for m in before {
        for part in [&m.role, &m.content, &m.extra] {
            h.write_u64(part.len() as u64);
            h.write(part.as_bytes());
        }
    }
    h.write_u64(tokens);
    let key = h.finish();
    let bytes = per_token.checked_mul(tokens)?;
    Some(SharedPrefix {
        key: key.max(1),
        bytes,
    })
}

#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Admitted {
        lease: Lease,
        /// The cap to write into the forwarded body.
        cap: u64,
        /// `Some(asked)` when a degrade policy lowered the cap from `asked` to `cap`.
        degraded_from: Option<u64>,
        /// Leases of lower classes demoted to make room (as they were before: they stay in the
        /// ledger reserving nothing until their requests end); the caller demotes them at the
        /// backend, where they go on in borrowed blocks and are at worst recomputed later.
        preempted: Vec<Lease>,
    },
    Rejected(ApiError),
}

/// Who will hold the lease: its id (`None`: the ledger assigns one) and the worker that owns
/// its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub lease_id: Option<u64>,
    pub owner: u64,
    /// Fair retries: the request's place in line (see `ledger`).
    pub claim: Option<crate::ledger::ClaimTicket>,
}

/// Decide and reserve. Pure over the ledger: safe to re-run on a CAS retry. A request whose
/// shared prefix a live lease pays is admitted without it.
pub fn decide(
    ledger: &mut Ledger,
    cfg: &Config,
    class: &ClassPolicy,
    priced: &Priced,
    holder: Holder,
    now_ms: u64,
    jitter_seed: u64,
) -> Decision {
    let credit = priced.credit_in(ledger);
    let decision = decide_with(
        ledger,
        cfg,
        class,
        priced,
        holder,
        now_ms,
        jitter_seed,
        credit,
    );
    mark_prefix(ledger, priced, decision, credit)
}

/// The admitted lease starts with `priced`'s prefix, `credit` of it paid by another lease.
fn mark_prefix(ledger: &mut Ledger, priced: &Priced, mut d: Decision, credit: u64) -> Decision {
    if let (Decision::Admitted { lease, .. }, Some(p)) = (&mut d, priced.prefix) {
        ledger.set_prefix(lease.id, p.key, credit);
        lease.prefix = p.key;
        lease.credit = credit;
    }
    d
}

#[allow(clippy::too_many_arguments)]
fn decide_with(
    ledger: &mut Ledger,
    cfg: &Config,
    class: &ClassPolicy,
    priced: &Priced,
    holder: Holder,
    now_ms: u64,
    jitter_seed: u64,
    credit: u64,
) -> Decision {
    // A degrade class asking for more than the whole budget can ever hold: priced at the
    // largest cap it holds, then as any other request (admitted, degraded further to what is
    // free now, or told when to come back). Below `min_output_tokens` it stays too large (413).
    let at_budget;
    let (priced, asked) = match &class.action {
        Action::Degrade { min_output_tokens }
            if priced.elastic.is_none() && priced.price.bytes > ledger.capacity() =>
        {
            let cap = priced.price.cap.cap;
            match largest_cap_that_fits(
                &cfg.pricing,
                &priced.prompt_tokens,
                priced.choices,
                cap,
                ledger.capacity(),
            )
            .filter(|c| *c >= (*min_output_tokens).min(cap))
            .and_then(|c| {
                price_request(&cfg.pricing, &priced.prompt_tokens, Some(c), priced.choices).ok()
            }) {
                Some(price) => {
                    at_budget = Priced {
                        price,
                        ..priced.clone()
                    };
                    (&at_budget, Some(cap))
                }
                None => (priced, None),
            }
        }
        _ => (priced, None),
    };
    let cap = priced.price.cap.cap;
    let request = |bytes: u64| admit_request(class, holder, bytes.saturating_sub(credit), now_ms);
    let outcome = ledger.try_admit(
        &request(priced.reserve_bytes()),
        &cfg.retry_after,
        jitter_seed,
    );
    let (reason, need, free, retry_after) = match outcome {
        AdmitOutcome::Admitted { lease } => {
            return Decision::Admitted {
                lease,
                cap,
                degraded_from: asked,
                preempted: Vec::new(),
            }
        }
        AdmitOutcome::Rejected {
            reason,
            need,
            free,
            retry_after,
        } => (reason, need, free, retry_after),
    };
    if let (Action::Degrade { min_output_tokens }, RejectReason::InsufficientCapacity) =
        (&class.action, reason)
    {
        let fits = largest_cap_that_fits(
            &cfg.pricing,
            &priced.prompt_tokens,
            priced.choices,
            cap,
            free,
        );
        if let Some(smaller) = fits.filter(|c| *c >= (*min_output_tokens).min(cap)) {
            if let Ok(p) = price_request(
                &cfg.pricing,
                &priced.prompt_tokens,
                Some(smaller),
                priced.choices,
            ) {
                // The first attempt counted a rejection; this one replaces it.
                ledger.uncount_rejection();
                if let AdmitOutcome::Admitted { lease } =
                    ledger.try_admit(&request(p.bytes), &cfg.retry_after, jitter_seed)
                {
                    return Decision::Admitted {
                        lease,
                        cap: smaller,
                        degraded_from: Some(asked.unwrap_or(cap)),
                        preempted: Vec::new(),
                    };
                }
            }
        }
    }
    if reason == RejectReason::InsufficientCapacity && !class.preempts.is_empty() {
        // What elastic sequences borrowed first: taken back at the backend, it preempts nobody.
        if let Some(lease) = ledger.admit_into_lent(&request(priced.reserve_bytes())) {
            ledger.uncount_rejection();
            return Decision::Admitted {
                lease,
                cap,
                degraded_from: None,
                preempted: Vec::new(),
            };
        }
        let own_held = holder.claim.map_or(0, |t| ledger.held_for(t.key));
        // The lease paying the prefix this request is credited for is no victim: demoted, it
        // would leave the credit unpaid.
        let payer_of = priced.prefix.filter(|_| credit > 0).map_or(0, |p| p.key);
        if let Some(victims) = choose_victims(ledger, class, need, own_held, payer_of) {
            // Demoted only if that admits it: a lease demoted for nothing would be recomputed
            // for nothing.
            let before = ledger.clone();
            let preempted: Vec<Lease> =
                victims.iter().filter_map(|id| ledger.demote(*id)).collect();
            ledger.uncount_rejection();
            if let Some(lease) = ledger.admit_into_lent(&request(priced.reserve_bytes())) {
                return Decision::Admitted {
                    lease,
                    cap,
                    degraded_from: None,
                    preempted,
                };
            }
            *ledger = before;
        }
    }
    Decision::Rejected(rejection(
        reason,
        need,
        free,
        ledger,
        retry_after.map(|r| r.ms),
    ))
}

/// Only a backfill ([`Ledger::try_backfill`]): for a request waiting in a gateway's queue
/// behind its front, admitted only if it is expected to be done before anyone in line could
/// start; `None` changes nothing.
pub fn backfill(
    ledger: &mut Ledger,
    cfg: &Config,
    class: &ClassPolicy,
    priced: &Priced,
    holder: Holder,
    now_ms: u64,
) -> Option<Decision> {
    let cap = priced.price.cap.cap;
    let credit = priced.credit_in(ledger);
    let bytes = priced.reserve_bytes().saturating_sub(credit);
    let req = admit_request(class, holder, bytes, now_ms);
    let lease = ledger.try_backfill(&req, &cfg.retry_after)?;
    let d = Decision::Admitted {
        lease,
        cap,
        degraded_from: None,
        preempted: Vec::new(),
    };
    Some(mark_prefix(ledger, priced, d, credit))
}

/// Shadow mode: what [`decide`] would do, decided on a copy of the ledger; the ledger itself
/// records the request at its full worst case whatever the decision (it goes through
/// unchanged, so that is what the backend may come to hold). A lease id that is already live
/// records nothing: the answer is then the duplicate-id refusal (`ErrorKind::LeaseIdTaken`),
/// and the request must go through without the lease, which is another request's.
pub fn shadow(
    ledger: &mut Ledger,
    cfg: &Config,
    class: &ClassPolicy,
    priced: &Priced,
    holder: Holder,
    now_ms: u64,
    jitter_seed: u64,
) -> Decision {
    let mut scratch = ledger.clone();
    let decision = decide(
        &mut scratch,
        cfg,
        class,
        priced,
        Holder {
            claim: None,
            ..holder
        },
        now_ms,
        jitter_seed,
    );
    let holder = Holder {
        claim: None,
        ..holder
    };
    let recorded = ledger.record(&admit_request(class, holder, priced.price.bytes, now_ms));
    if recorded {
        decision
    } else {
        Decision::Rejected(rejection(
            RejectReason::DuplicateId,
            priced.reserve_bytes(),
            ledger.free(),
            ledger,
            None,
        ))
    }
}

/// What the ledger is asked to reserve for `holder`'s request of class `class`.
fn admit_request(class: &ClassPolicy, holder: Holder, bytes: u64, now_ms: u64) -> AdmitRequest<'_> {
    AdmitRequest {
        id: holder.lease_id,
        bytes,
        class: &class.name,
        priority: class.priority,
        now_ms,
        owner: holder.owner,
        claim: holder.claim,
    }
}

/// The youngest leases (least work lost) of the classes `class` may preempt whose bytes, with
/// what is free for this request (its own claim's `own_held` included), cover `need`; `None`
/// when even all of them would not. A lease demoted before reserves nothing and is passed over.
///
/// What is free after a demotion is counted as the admission that follows counts it
/// (`Ledger::lent_room_after_demoting`): a demoted lease's bytes are room at once, and what
/// elastic sequences borrowed is taken back from them by the backend (they resume later), so
/// it is never paid for with more demoted leases. Counted as plain free room (held back first
/// paid off by the freed bytes), a vip under sustained overload preempted 74–99 leases
/// (3.3–4.4 GB) for 23 MB in the simulator at GPU scale.
fn choose_victims(
    ledger: &Ledger,
    class: &ClassPolicy,
    need: u64,
    own_held: u64,
    payer_of: u64,
) -> Option<Vec<u64>> {
    let pays = |l: &Lease| payer_of != 0 && l.prefix == payer_of && l.credit == 0;
    let mut candidates: Vec<&Lease> = ledger
        .leases()
        .iter()
        .filter(|l| l.bytes > 0 && l.priority < class.priority && class.preempts.contains(&l.class))
        .filter(|l| !pays(l))
        .collect();
    candidates.sort_by_key(|l| std::cmp::Reverse(l.created_ms));
    let free_after = |demoted: u64| ledger.lent_room_after_demoting(demoted, own_held);
    let mut demoted = 0u64;
    let mut ids = Vec::new();
    for l in candidates {
        if free_after(demoted) >= need {
            break;
        }
        demoted = demoted.saturating_add(l.bytes);
        ids.push(l.id);
    }
    (free_after(demoted) >= need).then_some(ids)
}

fn rejection(
    reason: RejectReason,
    need: u64,
    free: u64,
    ledger: &Ledger,
    retry_after_ms: Option<u64>,
) -> ApiError {
    let err = match reason {
        RejectReason::ExceedsCapacity => ApiError::new(
            ErrorKind::KvRequestTooLarge,
            format!(
                "This request needs {need} bytes of KV cache at its worst case, more than the \
                 gateway's whole usable budget of {} bytes. Lower max_tokens or the prompt length; \
                 retrying will not help.",
                ledger.capacity()
            ),
        ),
        RejectReason::DuplicateId => ApiError::new(
            ErrorKind::LeaseIdTaken,
            "kvgate drew a lease id that is already live; nothing was reserved. Retry.",
        ),
        RejectReason::InsufficientCapacity => ApiError::new(
            ErrorKind::KvCapacityExceeded,
            format!(
                "The KV cache budget is spent: this request needs {need} bytes at its worst case \
                 and {free} bytes are free. Retry after the time in the Retry-After header, or \
                 lower max_tokens."
            ),
        ),
    };
    let err = err
        .with_extra("need_bytes", need)
        .with_extra("free_bytes", free);
    match retry_after_ms {
        Some(ms) => err.with_retry_after_ms(ms),
        None => err,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANY: Holder = Holder {
        lease_id: None,
        owner: 1,
        claim: None,
    };
    use crate::request::{parse_request, Endpoint};
    use crate::tokenize::{Encoding, TokenizerSpec};

    fn cfg(policy: &str, budget_tokens: u64) -> Config {
        // 46,080 B per token; safety 1.0 so capacity is exactly `budget_tokens` tokens. A class
        // that preempts needs the backend callout (its victims are demoted there).
        let backend = if policy.contains("preempts") {
            r#","backend":{}"#
        } else {
            ""
        };
        let json = format!(
            r#"{{"model":{{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192}},
                "kv_budget_bytes":{},"safety_fraction":1.0,"policy":{policy}{backend}}}"#,
            budget_tokens * 46_080
        );
        Config::from_json(json.as_bytes()).unwrap()
    }

    fn counter() -> TokenCounter {
        TokenCounter::new(&TokenizerSpec::Builtin(Encoding::Cl100kBase)).unwrap()
    }

    fn priced(c: &Config, body: &str) -> Priced {
        let (req, _) = parse_request(Endpoint::Completions, body.as_bytes()).unwrap();
        price(c, &counter(), &req).unwrap()
    }

    #[test]
    fn an_approximate_tokenizer_pads_text_and_digits_and_leaves_token_arrays_exact() {
        let c = Config::from_json(
            br#"{"model":{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192},
                "kv_budget_bytes":1000000000,"tokenizer":{"encoding":"cl100k_base","multiplier":1.5}}"#,
        )
        .unwrap();
        let cl = counter();
        let digits = "2026 12 06 314159265";
        let counted = cl.count_text(digits);
        // Runs of 4, 2, 2 and 9 digits: 2 + 1 + 1 + 6 past cl100k_base's chunks of three.
        let padded = (counted as f64 * 1.5).ceil() as u64 + 10;
        let body = format!(r#"{{"prompt":[{digits:?},[1,2,3]],"max_tokens":5}}"#);
        assert_eq!(priced(&c, &body).prompt_tokens, vec![padded, 3]);
        // A chat: the digits of every message's content, and of its other fields, are padded.
        let chat = format!(
            r#"{{"messages":[{{"role":"user","content":{digits:?},"name":"u42"}}],"max_tokens":5}}"#
        );
        let (req, _) = parse_request(Endpoint::ChatCompletions, chat.as_bytes()).unwrap();
        let unpadded = cl.count_input(&req.input);
        assert_eq!(
            price(&c, &cl, &req).unwrap().prompt_tokens,
            vec![(unpadded[0] as f64 * 1.5).ceil() as u64 + 10 + 1]
        );
        // A run of digits long enough is refused over the context it would fill once served a
        // token a digit, not admitted at a third of it.
        let long = format!(r#"{{"prompt":"{}","max_tokens":5}}"#, "7".repeat(9000));
        let (req, _) = parse_request(Endpoint::Completions, long.as_bytes()).unwrap();
        assert_eq!(cl.count_input(&req.input), vec![3000]);
        let e = price(&c, &cl, &req).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ContextLengthExceeded);
        // The refusal says the count is the gateway's approximation (and one of token ids
        // does not).
        let said = format!("{APPROXIMATE_COUNT} {TOKEN_IDS_EXACT}");
        assert!(e.message.ends_with(&said), "{}", e.message);
        let ids = format!(r#"{{"prompt":{:?},"max_tokens":5}}"#, vec![1; 9000]);
        let (req, _) = parse_request(Endpoint::Completions, ids.as_bytes()).unwrap();
        let e = price(&c, &cl, &req).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ContextLengthExceeded);
        assert!(!e.message.contains(APPROXIMATE_COUNT), "{}", e.message);
        // A chat has no token ids to offer instead.
        let chat = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "7".repeat(9000)
        );
        let (req, _) = parse_request(Endpoint::ChatCompletions, chat.as_bytes()).unwrap();
        let e = price(&c, &cl, &req).unwrap_err();
        assert!(e.message.ends_with(APPROXIMATE_COUNT), "{}", e.message);
    }

    #[test]
    fn from_backend_pads_its_fallback_until_the_descriptor_and_runs_only_when_asked() {
        let spec =
            r#"{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192}"#;
        let with = |extra: &str| {
            Config::from_json(
                format!(r#"{{"model":"from_backend","fallback_model":{spec},"kv_budget_bytes":1000000000,"backend":{{}}{extra}}}"#)
                    .as_bytes(),
            )
            .unwrap()
        };
        let cl = counter();
        let text = format!("{}\n\n\n\n\n\n\n\n", "1".repeat(30));
        let body = format!(r#"{{"prompt":{text:?},"max_tokens":5}}"#);
        let counted = cl.count_text(&text);
        let scaled = (counted as f64 * 1.25).ceil() as u64;
        // Before the descriptor: the default fallback pad (1.25) and the runs (30 digits: 20;
        // 8 newlines: 1).
        let c = with("");
        assert_eq!(priced(&c, &body).prompt_tokens, vec![scaled + 21]);
        // Runs turned off: the multiplier alone.
        let off = with(r#","tokenizer":{"pad_runs":false}"#);
        assert_eq!(priced(&off, &body).prompt_tokens, vec![scaled]);
        // Once the descriptor's tokenizer (the model's own) is in, the count is exact.
        let d = crate::reconcile::Descriptor {
            spec: c.pricing.spec,
            fingerprint: String::new(),
            kv_capacity_bytes: 1_000_000_000,
            scratch_margin_bytes: 0,
            tokenizer: c.tokenizer.clone(),
            served: c.served.clone(),
            prefix_caching: false,
        };
        let exact = c.with_descriptor(d).unwrap();
        assert_eq!(priced(&exact, &body).prompt_tokens, vec![counted]);
    }

    #[test]
    fn shadow_decides_as_enforce_and_records_every_request_at_its_worst_case() {
        let c = cfg("{}", 5000);
        let class = c.policy.default_class().clone();
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        let p = priced(
            &c,
            &format!(r#"{{"prompt":{:?},"max_tokens":3000}}"#, vec![1; 200]),
        );
        let holder = |id| Holder {
            lease_id: Some(id),
            owner: 1,
            claim: None,
        };
        assert!(matches!(
            shadow(&mut l, &c, &class, &p, holder(1), 0, 1),
            Decision::Admitted { .. }
        ));
        // Enforce would refuse the second; shadow says so and still records it.
        let Decision::Rejected(e) = shadow(&mut l, &c, &class, &p, holder(2), 0, 1) else {
            panic!("enforce would refuse")
        };
        assert_eq!(e.kind, ErrorKind::KvCapacityExceeded);
        assert_eq!(l.committed(), 2 * p.price.bytes);
        assert!(l.committed() > l.capacity());
        l.check().unwrap();
        let second = l.lease(2).cloned().unwrap();
        // An id already live records nothing: the duplicate-id refusal, and the live lease
        // (another request's) stays as it was.
        let Decision::Rejected(e) = shadow(&mut l, &c, &class, &p, holder(2), 5, 1) else {
            panic!("a live id is not recorded twice")
        };
        assert_eq!((e.kind, e.status), (ErrorKind::LeaseIdTaken, 503));
        assert_eq!(e.kind.code(), "kvgate_lease_id_conflict");
        assert_eq!(l.committed(), 2 * p.price.bytes);
        assert_eq!(l.leases().len(), 2);
        assert_eq!(
            l.release(2, 10),
            crate::ledger::ReleaseOutcome::Released(second)
        );
    }

    #[test]
    fn a_shared_prefix_is_charged_once_while_a_lease_pays_it_and_handed_on_when_it_ends() {
        // Behind kvgate-backend (the callout), a chat's messages before its last are a prefix
        // the live requests that share it pay once.
        let c = Config::from_json(
            br#"{"model":{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192},
                "kv_budget_bytes":460800000,"safety_fraction":1.0,"backend":{}}"#,
        )
        .unwrap();
        let class = c.policy.default_class().clone();
        let system = "Use the tools. ".repeat(200);
        let agent = |task: &str| {
            let body = format!(
                r#"{{"messages":[{{"role":"system","content":{system:?}}},{{"role":"user","content":{task:?}}}],"max_tokens":64}}"#
            );
            let (req, _) = parse_request(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
            price(&c, &counter(), &req).unwrap()
        };
        let (a, b, d) = (agent("one"), agent("two"), agent("three"));
        let p = a.prefix.unwrap();
        assert_eq!(
            b.prefix.map(|q| q.key),
            Some(p.key),
            "same messages before the last"
        );
        let tokens = p.bytes / 46_080;
        assert_eq!(tokens % PREFIX_GRAIN, 0);
        assert!(
            tokens < a.prompt_tokens[0] && tokens + 2 * PREFIX_GRAIN >= a.prompt_tokens[0] - 10,
            "the system prompt, rounded down: {tokens} of {:?}",
            a.prompt_tokens
        );
        // A different system prompt, a one-message chat, a completion: nothing to share.
        let other = format!(
            r#"{{"messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"x"}}],"max_tokens":64}}"#,
            "Other. ".repeat(200)
        );
        let (req, _) = parse_request(Endpoint::ChatCompletions, other.as_bytes()).unwrap();
        assert_ne!(
            price(&c, &counter(), &req).unwrap().prefix.unwrap().key,
            p.key
        );
        let one = r#"{"messages":[{"role":"user","content":"x"}]}"#;
        let (req, _) = parse_request(Endpoint::ChatCompletions, one.as_bytes()).unwrap();
        assert_eq!(price(&c, &counter(), &req).unwrap().prefix, None);
        // Without the backend callout (nothing says what the backend shares): none.
        assert_eq!(priced(&cfg("{}", 5000), r#"{"prompt":"x"}"#).prefix, None);

        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        let holder = |id| Holder {
            lease_id: Some(id),
            owner: 1,
            claim: None,
        };
        let admit =
            |l: &mut Ledger, p: &Priced, id| match decide(l, &c, &class, p, holder(id), 0, 1) {
                Decision::Admitted { lease, .. } => lease,
                d => panic!("{d:?}"),
            };
        let first = admit(&mut l, &a, 1);
        assert_eq!(
            (first.bytes, first.credit),
            (a.price.bytes, 0),
            "it pays the prefix"
        );
        let second = admit(&mut l, &b, 2);
        assert_eq!(second.bytes, b.price.bytes - p.bytes);
        assert_eq!(second.credit, p.bytes);
        let third = admit(&mut l, &d, 3);
        assert_eq!(
            l.committed(),
            a.price.bytes + b.price.bytes + d.price.bytes - 2 * p.bytes
        );
        l.check().unwrap();
        // The payer ends: the next pays from now on; the ledger charges the prefix still once,
        // and what stays committed stays in the slack (only the rest may have been slack).
        l.set_slack(a.price.bytes);
        l.release(1, 5);
        assert_eq!(l.slack(), p.bytes);
        let next = l.lease(2).unwrap();
        assert_eq!((next.bytes, next.credit), (b.price.bytes, 0));
        assert_eq!(l.committed(), b.price.bytes + d.price.bytes - p.bytes);
        assert_eq!(l.lease(3).unwrap().credit, third.credit);
        l.check().unwrap();
        // A payer demoted (reserving nothing) hands it on too, and shares no charge after.
        l.demote(2);
        assert_eq!(l.lease(3).unwrap().bytes, d.price.bytes);
        assert_eq!(
            (l.lease(2).unwrap().prefix, l.lease(2).unwrap().credit),
            (0, 0)
        );
        l.check().unwrap();
        l.release(2, 6);
        l.release(3, 7);
        assert_eq!(l.committed(), 0);
        // A codec round trip keeps who pays.
        admit(&mut l, &a, 4);
        admit(&mut l, &b, 5);
        assert_eq!(Ledger::decode(&l.encode()).unwrap(), l);
    }

    #[test]
    fn an_elastic_request_reserves_its_allowance_and_keeps_its_cap() {
        let c = cfg("{}", 5000);
        let class = c.policy.default_class().clone();
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        let body = format!(r#"{{"prompt":{:?},"max_tokens":4000}}"#, vec![1; 200]);
        // Worst case: 4,200 tokens, so only one fits in 5,000.
        let p = priced(&c, &body).with_allowance(&c, 300);
        let e = p.elastic.expect("an allowance below the cap is elastic");
        assert_eq!(e.output_tokens, 300);
        let at_300 = price_request(&c.pricing, &[200], Some(300), 1).unwrap();
        assert_eq!(e.bytes, at_300.bytes);
        assert_eq!(p.reserve_bytes(), e.bytes);
        for id in 1..=3 {
            let Decision::Admitted { cap, lease, .. } = decide(
                &mut l,
                &c,
                &class,
                &p,
                Holder {
                    lease_id: Some(id),
                    ..ANY
                },
                0,
                1,
            ) else {
                panic!("three elastic requests of 500 tokens fit in 5,000")
            };
            assert_eq!(cap, 4000, "the request keeps its cap");
            assert_eq!(lease.bytes, e.bytes);
        }
        assert_eq!(l.committed(), 3 * e.bytes);
        // An allowance at or above the cap is the worst case.
        let worst = priced(&c, &body).with_allowance(&c, 4000);
        assert_eq!(worst.elastic, None);
        assert_eq!(worst.reserve_bytes(), worst.price.bytes);
    }

    #[test]
    fn reject_policy_answers_429_with_retry_after() {
        let c = cfg("{}", 5000);
        let class = c.policy.default_class().clone();
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        // A 200-token prompt (token array) with max_tokens=4000 reserves 4,200 tokens.
        let p = priced(
            &c,
            &format!(r#"{{"prompt":{:?},"max_tokens":4000}}"#, vec![1; 200]),
        );
        assert_eq!(p.price.reserved_tokens, 4200);
        let Decision::Admitted { cap, .. } = decide(&mut l, &c, &class, &p, ANY, 0, 1) else {
            panic!()
        };
        assert_eq!(cap, 4000);
        assert_eq!(l.committed(), 4200 * 46_080);
        match decide(&mut l, &c, &class, &p, ANY, 1, 1) {
            Decision::Rejected(e) => {
                assert_eq!(e.status, 429);
                assert_eq!(e.kind.code(), "kv_capacity_exceeded");
                assert!(e.retry_after_ms.is_some());
                let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
                assert_eq!(v["error"]["need_bytes"], 4200 * 46_080);
                assert_eq!(v["error"]["free_bytes"], 800 * 46_080);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(l.counters().rejected, 1);
    }

    /// A 5,000-token budget whose default class degrades (to at least 100 tokens), an empty
    /// ledger, and a pricer of 200-token prompts asking for `max_tokens`.
    fn degrading() -> (Config, ClassPolicy, Ledger, impl Fn(&Config, u64) -> Priced) {
        let c = cfg(
            r#"{"classes":{"default":{"action":"degrade","min_output_tokens":100}}}"#,
            5000,
        );
        let class = c.policy.default_class().clone();
        let l = Ledger::new(c.pricing.capacity_bytes, 1);
        let ask = |c: &Config, max_tokens: u64| {
            priced(
                c,
                &format!(
                    r#"{{"prompt":{:?},"max_tokens":{max_tokens}}}"#,
                    vec![1; 200]
                ),
            )
        };
        (c, class, l, ask)
    }

    #[test]
    fn degrade_lowers_the_cap_and_says_so() {
        let (c, class, mut l, ask) = degrading();
        let p = ask(&c, 4000);
        assert!(matches!(
            decide(&mut l, &c, &class, &p, ANY, 0, 1),
            Decision::Admitted {
                degraded_from: None,
                ..
            }
        ));
        // 800 tokens free: 200 prompt + 600 output.
        match decide(&mut l, &c, &class, &p, ANY, 0, 1) {
            Decision::Admitted {
                cap,
                degraded_from,
                lease,
                ..
            } => {
                assert_eq!((cap, degraded_from), (600, Some(4000)));
                assert_eq!(lease.bytes, 800 * 46_080);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(l.committed(), l.capacity());
        assert_eq!(l.counters().rejected, 0);
        // Nothing left: below min_output_tokens → 429.
        assert!(
            matches!(decide(&mut l, &c, &class, &p, ANY, 0, 1), Decision::Rejected(e) if e.status == 429)
        );
    }

    #[test]
    fn degrade_lowers_a_cap_larger_than_the_whole_budget() {
        let (c, class, mut l, ask) = degrading();
        // 200 + 6,000 tokens: more than the 5,000 the budget holds even when empty.
        let p = ask(&c, 6000);
        match decide(&mut l, &c, &class, &p, ANY, 0, 1) {
            Decision::Admitted {
                cap, degraded_from, ..
            } => assert_eq!((cap, degraded_from), (4800, Some(6000))),
            other => panic!("{other:?}"),
        }
        assert_eq!(l.counters().rejected, 0);
        // With room for 800 tokens left: degraded further, still from the cap it asked for.
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        let small = ask(&c, 4000);
        assert!(matches!(
            decide(&mut l, &c, &class, &small, ANY, 0, 1),
            Decision::Admitted { .. }
        ));
        match decide(&mut l, &c, &class, &p, ANY, 0, 1) {
            Decision::Admitted {
                cap, degraded_from, ..
            } => assert_eq!((cap, degraded_from), (600, Some(6000))),
            other => panic!("{other:?}"),
        }
        // Nothing left: a 429 to come back after, not a 413 that says retrying cannot help.
        match decide(&mut l, &c, &class, &p, ANY, 0, 1) {
            Decision::Rejected(e) => {
                assert_eq!(e.status, 429);
                assert!(e.retry_after_ms.is_some());
            }
            other => panic!("{other:?}"),
        }
        // A class that rejects still says it can never fit.
        let reject = cfg("{}", 5000);
        let mut l = Ledger::new(reject.pricing.capacity_bytes, 1);
        let class = reject.policy.default_class().clone();
        assert!(matches!(
            decide(&mut l, &reject, &class, &priced(&reject, &format!(r#"{{"prompt":{:?},"max_tokens":6000}}"#, vec![1; 200])), ANY, 0, 1),
            Decision::Rejected(e) if e.status == 413
        ));
    }

    /// A 10k-token budget; batch (priority 1) and vip (5, preempts batch) beside the default
    /// class; a request of 3k tokens.
    fn preempting_classes() -> (Config, ClassPolicy, ClassPolicy, ClassPolicy, Priced) {
        let c = cfg(
            r#"{"classes":{"default":{},"batch":{"priority":1},"vip":{"priority":5,"preempts":["batch"]}}}"#,
            10_000,
        );
        let class = |n: &str| c.policy.get(n).unwrap().clone();
        let (batch, vip, def) = (class("batch"), class("vip"), class("default"));
        let p3k = priced(
            &c,
            &format!(r#"{{"prompt":{:?},"max_tokens":2900}}"#, vec![1; 100]),
        );
        (c, batch, vip, def, p3k)
    }

    #[test]
    fn a_preempting_request_never_demotes_the_lease_paying_its_shared_prefix() {
        // Three batch leases; the youngest pays a 1,000-token prefix. A vip with the same
        // prefix, credited for it, needs more than is free: the next youngest goes, never the
        // payer (its credit would be left unpaid, the ledger unreadable).
        let (c, batch, vip, _, p3k) = preempting_classes();
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        let prefix = SharedPrefix {
            key: 5,
            bytes: 1_000 * 46_080,
        };
        let agent = Priced {
            prefix: Some(prefix),
            ..p3k.clone()
        };
        let holder = |id| Holder {
            lease_id: Some(id),
            owner: 1,
            claim: None,
        };
        for (id, p) in [(1, &p3k), (2, &p3k), (3, &agent)] {
            assert!(matches!(
                decide(&mut l, &c, &batch, p, holder(id), id, 1),
                Decision::Admitted { .. }
            ));
        }
        // 1k free; the vip needs 3k less its 1k prefix.
        match decide(&mut l, &c, &vip, &agent, holder(4), 4, 1) {
            Decision::Admitted {
                lease, preempted, ..
            } => {
                assert_eq!(lease.credit, prefix.bytes);
                assert_eq!(preempted.iter().map(|v| v.id).collect::<Vec<_>>(), vec![2]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            l.lease(3).map(|v| (v.bytes, v.credit)),
            Some((p3k.price.bytes, 0))
        );
        l.check().unwrap();
        Ledger::decode(&l.encode()).unwrap();
    }

    #[test]
    fn preempt_demotes_the_youngest_lower_class_leases() {
        let (c, batch, vip, def, p3k) = preempting_classes();
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        // t=0 default 3k, t=1 batch 3k, t=2 batch 3k: 9k of 10k.
        for (t, class) in [(0, &def), (1, &batch), (2, &batch)] {
            assert!(matches!(
                decide(&mut l, &c, class, &p3k, ANY, t, 1),
                Decision::Admitted { .. }
            ));
        }
        // vip needs 3k with 1k free: demotes one batch lease, the youngest (t=2), which stays
        // in the ledger reserving nothing until its request ends.
        match decide(&mut l, &c, &vip, &p3k, ANY, 3, 1) {
            Decision::Admitted { preempted, .. } => {
                assert_eq!(preempted.len(), 1);
                assert_eq!(preempted[0].created_ms, 2);
                assert_eq!(preempted[0].class, "batch");
                assert_eq!(preempted[0].bytes, 3_000 * 46_080, "as it was");
                assert_eq!(l.lease(preempted[0].id).map(|v| v.bytes), Some(0));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(l.committed(), 9_000 * 46_080);
        assert_eq!(l.leases().len(), 4);
        // Another vip: demotes the last batch lease that reserves anything (a demoted lease
        // frees nothing more); the default lease is not preemptible.
        assert!(
            matches!(decide(&mut l, &c, &vip, &p3k, ANY, 4, 1), Decision::Admitted { preempted, .. } if preempted.len() == 1)
        );
        assert!(
            matches!(decide(&mut l, &c, &vip, &p3k, ANY, 5, 1), Decision::Rejected(e) if e.status == 429)
        );
        // batch cannot preempt anything.
        assert!(matches!(
            decide(&mut l, &c, &batch, &p3k, ANY, 6, 1),
            Decision::Rejected(_)
        ));
        l.check().unwrap();
    }

    #[test]
    fn a_preempting_class_demotes_only_what_it_lacks_not_what_borrowers_grew_into() {
        let (c, batch, vip, _, p3k) = preempting_classes();
        let token = 46_080;
        let p500 = priced(
            &c,
            &format!(r#"{{"prompt":{:?},"max_tokens":400}}"#, vec![1; 100]),
        );
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        for t in 0..18 {
            assert!(matches!(
                decide(&mut l, &c, &batch, &p500, ANY, t, 1),
                Decision::Admitted { .. }
            ));
        }
        // 9k of 10k promised; elastic sequences grew 4k past their reservations, all of it
        // lendable (the pool's blocks past the ledger's safety fraction, or blocks promised
        // and not grown into): held back is 3k more than what is left uncommitted.
        l.set_held_back(4_000 * token);
        l.set_lendable(4_000 * token);
        // The vip needs 3k: 1k is uncommitted, so it demotes 2k of batch leases (4 of 500),
        // the youngest. Counting held back as paid off first by the freed bytes, it preempted
        // 12 (6k) for the same 3k.
        match decide(&mut l, &c, &vip, &p3k, ANY, 18, 1) {
            Decision::Admitted { preempted, .. } => {
                assert_eq!(preempted.len(), 4);
                assert!(preempted.iter().all(|v| v.created_ms >= 14));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(l.committed(), 10_000 * token);
        assert_eq!(l.leases().len(), 19);
        assert_eq!(l.leases().iter().filter(|v| v.bytes == 0).count(), 4);
        l.check().unwrap();
    }

    #[test]
    fn a_preempting_class_takes_back_borrowed_blocks_before_it_demotes_anyone() {
        let (c, batch, vip, _, p3k) = preempting_classes();
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        for t in 0..2 {
            assert!(matches!(
                decide(&mut l, &c, &batch, &p3k, ANY, t, 1),
                Decision::Admitted { .. }
            ));
        }
        // The two batch sequences are elastic and have grown 3.5k past their reservations,
        // 3k of it lendable: 500 tokens' room is free to all, 3k more to the vip.
        let token = 46_080;
        l.set_held_back(3_500 * token);
        l.set_lendable(3_000 * token);
        assert_eq!(l.free(), 500 * token);
        match decide(&mut l, &c, &vip, &p3k, ANY, 2, 1) {
            Decision::Admitted { preempted, .. } => assert!(preempted.is_empty()),
            other => panic!("{other:?}"),
        }
        assert_eq!(l.leases().len(), 3);
        assert!(
            l.leases().iter().all(|v| v.bytes > 0),
            "no batch lease was demoted"
        );
        assert_eq!(l.counters().rejected, 0);
        // Of the 3k borrowed, 2.5k were lent; until the next poll what is held back (3.5k) is
        // more than the 1k left uncommitted, and the 500 not lent yet do not cover another
        // 3k. One batch lease demoted frees 3k of promises: with the 500 left, room for the
        // vip (9k promised and 500 firm: within the 10k). The borrowers give back what they
        // grew into; nobody else is demoted to pay for it.
        match decide(&mut l, &c, &vip, &p3k, ANY, 3, 1) {
            Decision::Admitted { preempted, .. } => assert_eq!(preempted.len(), 1),
            other => panic!("{other:?}"),
        }
        assert_eq!(l.leases().len(), 4);
        assert!(l.committed() + 500 * token <= l.capacity());
        // Nothing left to take back but the firm 500: the next vip demotes the last batch
        // lease, and a fourth is refused (the other two leases are vip's own class).
        assert!(
            matches!(decide(&mut l, &c, &vip, &p3k, ANY, 4, 1), Decision::Admitted { preempted, .. } if preempted.len() == 1)
        );
        assert!(matches!(
            decide(&mut l, &c, &vip, &p3k, ANY, 5, 1),
            Decision::Rejected(_)
        ));
        assert!(l.committed() + 500 * token <= l.capacity());
        // A class that may not preempt is not lent borrowed bytes (nor in line: see ledger).
        let mut m = Ledger::new(c.pricing.capacity_bytes, 1);
        m.set_held_back(9_000 * token);
        m.set_lendable(9_000 * token);
        assert!(matches!(
            decide(&mut m, &c, &batch, &p3k, ANY, 0, 1),
            Decision::Rejected(_)
        ));
        l.check().unwrap();
    }

    #[test]
    fn an_unset_cap_is_priced_at_the_context_the_budget_can_serve() {
        let c = cfg("{}", 1000);
        let class = c.policy.default_class().clone();
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        let served = c.pricing.served_context();
        assert!(served < 8192);
        let p = priced(&c, r#"{"prompt":"hi"}"#); // unset cap: what a whole budget can hold
        match decide(&mut l, &c, &class, &p, ANY, 0, 1) {
            Decision::Admitted { cap, .. } => {
                assert_eq!(cap + p.prompt_tokens[0], served);
            }
            other => panic!("{other:?}"),
        }
        assert!(l.committed() <= l.capacity());
    }

    #[test]
    fn too_large_for_the_budget_is_413_without_retry() {
        let c = cfg("{}", 1000);
        let class = c.policy.default_class().clone();
        let mut l = Ledger::new(c.pricing.capacity_bytes, 1);
        let p = priced(&c, r#"{"prompt":"hi","max_tokens":5000}"#); // asked for more than fits
        match decide(&mut l, &c, &class, &p, ANY, 0, 1) {
            Decision::Rejected(e) => {
                assert_eq!(e.status, 413);
                assert_eq!(e.kind.code(), "kv_request_too_large");
                assert!(e.retry_after_ms.is_none());
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(l.committed(), 0);
    }

    #[test]
    fn context_error_status_is_configurable() {
        let mut c = cfg("{}", 10_000);
        let (req, _) = parse_request(
            Endpoint::Completions,
            format!(r#"{{"prompt":{:?}}}"#, vec![1; 8192]).as_bytes(),
        )
        .unwrap();
        assert_eq!(price(&c, &counter(), &req).unwrap_err().status, 413);
        c.context_error_status = 400;
        let e = price(&c, &counter(), &req).unwrap_err();
        assert_eq!((e.status, e.kind.code()), (400, "context_length_exceeded"));
    }

    #[test]
    fn a_prompt_past_the_context_is_refused_as_more_than_the_context() {
        let c = cfg("{}", 10_000);
        // One piece without whitespace (issue 9's stalling prompt), past the context: counting
        // stops at the context, and the error says "more than" rather than a count it never made.
        for text in ["ab".repeat(60_000), "q".repeat(3 << 20)] {
            let body = format!(r#"{{"prompt":"{text}","max_tokens":10}}"#);
            let (req, _) = parse_request(Endpoint::Completions, body.as_bytes()).unwrap();
            let e = price(&c, &counter(), &req).unwrap_err();
            assert_eq!((e.status, e.kind.code()), (413, "context_length_exceeded"));
            assert!(e.message.contains("more than 8192 tokens"), "{}", e.message);
            assert!(e.message.contains("(10 output tokens requested)"));
        }
        // Token arrays past the context are refused the same way; at the context, with the count.
        let over = format!(r#"{{"prompt":{:?}}}"#, vec![1; 8193]);
        let (req, _) = parse_request(Endpoint::Completions, over.as_bytes()).unwrap();
        assert!(price(&c, &counter(), &req)
            .unwrap_err()
            .message
            .contains("more than 8192"));
        let at = format!(r#"{{"prompt":{:?}}}"#, vec![1; 8192]);
        let (req, _) = parse_request(Endpoint::Completions, at.as_bytes()).unwrap();
        assert!(price(&c, &counter(), &req)
            .unwrap_err()
            .message
            .contains("has 8192 tokens"));
    }
}

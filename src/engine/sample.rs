//! Position-indexed sampling: the next token from one row of logits, with no llama.cpp and no state.
//!
//! [`draw`] is a pure function of `(logits, params, draw_pos, allowed)`. The only randomness is one
//! uniform `u` in `[0, 1)` derived from `(params.seed, draw_pos)` alone (see [`uniform`]), so a
//! generation that is cut and continued later (in another process, after a crash, on another
//! batch layout) draws exactly what the uncut generation would have, given the same logits.
//!
//! The pipeline, in llama.cpp's usual order:
//!
//! 1. `allowed` (a grammar's verdict) and non-finite logits: excluded tokens are gone for good
//!    (NaN and `-inf` are excluded; `+inf` is clamped to `f32::MAX`).
//! 2. `temperature <= 0` (or NaN): greedy, the argmax; ties go to the lowest id. Nothing else
//!    applies.
//! 3. `top_k` (0 disables): keep the `k` largest logits (ties at the boundary: lowest ids win),
//!    with `select_nth_unstable_by` under a total order, so the kept set is exact and deterministic.
//! 4. temperature, then softmax. Tokens whose probability is below `1e-9` of the most likely
//!    token's are dropped before `exp` is even taken: over a 49,152-token vocabulary they hold
//!    at most ~5e-5 of the mass, which moves no probability by more than that fraction.
//! 5. `top_p` (< 1 enables; <= 0 keeps only the most likely token): the smallest set of most
//!    likely tokens whose mass reaches `top_p` of the softmax of step 4. Nothing is sorted
//!    whole: weights are bucketed by scaled logit (1/50 nat per bucket), the bucket where the
//!    cumulative mass crosses `top_p` is found, and only that bucket is sorted for the exact cut.
//! 6. `min_p` (> 0 enables): drop tokens whose probability is below `min_p` times the largest.
//! 7. Renormalise over what is left and pick by the cumulative distribution at `u`, walking the
//!    survivors in a fixed order (ascending id, then the sorted edge bucket of step 5). The same inputs always walk the same floats in the same order: same token.
//!
//! Sampling extras ([`SampleExtras`]) come before all of that: [`apply_extras`] adds the logit
//! bias and subtracts the presence and frequency penalties in place, and [`logprobs`] reads the
//! log-probabilities off the row so adjusted (the model's distribution, before temperature and
//! the filters). Both are pure: the counts of earlier draws are the caller's.

use crate::wire::{Params, SampleExtras, Token, TokenLogprob};

/// The golden-ratio increment of splitmix64.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// Drawn positions are mixed with this constant first, so `draw_pos` and `seed` do not simply XOR.
const POS_KEY: u64 = 0xD1B5_4A32_D192_ED03;
/// `ln(1e-9)`: scaled logits below this (relative to the max) are dropped (step 4).
const LN_DROP: f32 = -20.723_267;
/// Top-p buckets: scaled logits `0 ..= LN_DROP` in steps of 1/50 nat.
const N_BUCKETS: usize = 1037;
const BUCKETS_PER_NAT: f32 = 50.0;

/// The splitmix64 finaliser: a bijective 64-bit mix with full avalanche.
#[inline]
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform of the draw at `draw_pos` under `seed`, in `[0, 1)` with 53 random bits:
/// `splitmix64(seed ^ splitmix64(draw_pos ^ POS_KEY)) >> 11`, times `2^-53`.
///
/// It depends on nothing else: no sampler state, no thread, no batch. Nearby positions and nearby
/// seeds give unrelated values (each of the two mixes avalanches fully).
#[inline]
pub fn uniform(seed: u64, draw_pos: u64) -> f64 {
    let bits = splitmix64(seed ^ splitmix64(draw_pos ^ POS_KEY));
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Whether `params` asks for the greedy argmax (temperature 0, negative or NaN).
#[inline]
pub fn is_greedy(params: &Params) -> bool {
    params.temperature.is_nan() || params.temperature <= 0.0
}

/// Draw the next token from `logits` (one row, indexed by token id).
///
/// `allowed`, when given, must return true for the ids that may be drawn (a grammar's verdict);
/// the others are never drawn. If no token survives (every logit excluded, NaN or `-inf`), the
/// result is the argmax of the raw logits ignoring `allowed`, or 0 for an empty row: callers
/// that pass `allowed` must check beforehand that it allows something.
pub fn draw(
    logits: &[f32],
    params: &Params,
    draw_pos: u64,
    allowed: Option<&dyn Fn(u32) -> bool>,
) -> u32 {
    // Step 2 (and the max for step 4): the argmax, lowest id on ties.
    match allowed {
        None => draw_with(logits, params, draw_pos, argmax_all(logits), |_| true),
        Some(f) => {
            let best = argmax(logits, |id, l| l > f32::NEG_INFINITY && f(id));
            draw_with(logits, params, draw_pos, best, f)
        }
    }
}

/// [`draw`], monomorphised over the filter so the unfiltered case costs no call per token;
/// `best` is the argmax over what passes steps 1 and 2.
fn draw_with(
    logits: &[f32],
    params: &Params,
    draw_pos: u64,
    best: Option<u32>,
    allowed: impl Fn(u32) -> bool,
) -> u32 {
    // Step 1: NaN and -inf never pass (`l > -inf` is false for both).
    let ok = |id: u32, l: f32| l > f32::NEG_INFINITY && allowed(id);
    let Some(best) = best else {
        return fallback(logits);
    };
    if is_greedy(params) {
        return best;
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => sample_weighted(logits, params, draw_pos, ok, best, &mut scratch),
        // Only if `allowed` itself draws (re-entrancy): fresh buffers.
        Err(_) => sample_weighted(logits, params, draw_pos, ok, best, &mut Scratch::default()),
    })
}

/// Buffers reused from draw to draw on one thread (no allocation, no page faults per draw).
/// They carry no information from one draw to the next: every draw clears them first.
#[derive(Default)]
struct Scratch {
    w: Vec<Cand>,
    edge: Vec<Cand>,
    mass: Vec<f64>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Steps 3 to 7 of [`draw`], for a non-greedy draw whose argmax is `best`.
fn sample_weighted(
    logits: &[f32],
    params: &Params,
    draw_pos: u64,
    ok: impl Fn(u32, f32) -> bool,
    best: u32,
    scratch: &mut Scratch,
) -> u32 {
    let Scratch { w, edge, mass } = scratch;
    let max = logits[best as usize].min(f32::MAX);
    let t = params.temperature;

    // Step 4's cut first (it commutes with top-k: a token it drops is below the k-th best
    // anyway unless fewer than k survive it, and then top-k keeps everything that survived).
    // `w` holds (id, scaled logit) for now, in ascending id order.
    w.clear();
    for (id, &l) in logits.iter().enumerate() {
        if ok(id as u32, l) {
            let s = (l.min(f32::MAX) - max) / t;
            if s >= LN_DROP {
                w.push(Cand {
                    id: id as u32,
                    w: s,
                    bucket: 0,
                });
            }
        }
    }
    // The max itself always survives (s == 0).
    if w.is_empty() {
        return best;
    }
    // Step 3: top-k under the total order (scaled logit descending, id ascending).
    let k = params.top_k as usize;
    if k > 0 && k < w.len() {
        w.select_nth_unstable_by(k - 1, cand_desc);
        w.truncate(k);
        w.sort_unstable_by_key(|c| c.id);
    }
    // Step 4: softmax weights relative to the max (the max's weight is 1).
    for c in w.iter_mut() {
        let s = c.w;
        c.bucket = ((-s) * BUCKETS_PER_NAT) as u16;
        c.w = exp_neg(s);
    }

    // Step 5: top-p. Weights are bucketed by their scaled logit (buckets are monotone in weight);
    // buckets above the one where the mass crosses `top_p` are kept whole, and only that one
    // bucket is sorted to find the exact cut.
    let top_p = params.top_p;
    if top_p < 1.0 {
        let total: f64 = w.iter().map(|c| f64::from(c.w)).sum();
        let target = f64::from(top_p.max(0.0)) * total;
        mass.clear();
        mass.resize(N_BUCKETS, 0.0);
        for c in w.iter() {
            mass[usize::from(c.bucket).min(N_BUCKETS - 1)] += f64::from(c.w);
        }
        let mut cum = 0.0f64;
        let mut cut = None;
        for (b, &m) in mass.iter().enumerate() {
            if m > 0.0 && cum + m >= target {
                cut = Some(b);
                break;
            }
            cum += m;
        }
        if let Some(cut) = cut {
            let bucket = |c: &Cand| usize::from(c.bucket).min(N_BUCKETS - 1);
            edge.clear();
            edge.extend(w.iter().filter(|c| bucket(c) == cut).copied());
            // Ties are common in a flat edge (ids ascend already): skip the sort then.
            if !edge.is_sorted_by(|a, b| cand_desc(a, b).is_le()) {
                edge.sort_unstable_by(cand_desc);
            }
            let mut n = edge.len();
            for (i, c) in edge.iter().enumerate() {
                cum += f64::from(c.w);
                if cum >= target {
                    n = i + 1;
                    break;
                }
            }
            edge.truncate(n);
            w.retain(|c| bucket(c) < cut);
            w.extend_from_slice(edge);
        }
    }

    // Step 6: min-p relative to the max weight (1.0). Both filters keep a prefix of the
    // descending order, so applying min-p after top-p's cut is the intersection.
    let min_p = params.min_p;
    if min_p > 0.0 {
        w.retain(|c| c.w >= min_p);
        if w.is_empty() {
            // min_p > 1 would drop even the max: keep the most likely token, as llama.cpp does.
            return best;
        }
    }

    // Step 7: renormalise and pick by CDF, in the fixed order of `w`.
    let sum: f64 = w.iter().map(|c| f64::from(c.w)).sum();
    let target = uniform(params.seed, draw_pos) * sum;
    let mut cum = 0.0f64;
    for c in w.iter() {
        cum += f64::from(c.w);
        if cum > target {
            return c.id;
        }
    }
    w[w.len() - 1].id
}

/// Applies `extras` to a row of logits in place: for every token `t` drawn `c > 0` times before
/// (`counts`, each token at most once), `row[t] -= presence * 1 + frequency * c`; then each
/// `logit_bias` entry `(t, b)`, in order, `row[t] += b`. Ids outside the row are ignored (the
/// worker checks them against `n_vocab` first). The arithmetic is in a fixed order per token, so
/// the result does not depend on the order of `counts`.
pub fn apply_extras(
    row: &mut [f32],
    extras: &SampleExtras,
    counts: impl IntoIterator<Item = (Token, u32)>,
) {
    if extras.penalizes() {
        for (t, c) in counts {
            if c == 0 {
                continue;
            }
            if let Some(l) = row.get_mut(t as usize) {
                *l -= extras.presence_penalty + extras.frequency_penalty * c as f32;
            }
        }
    }
    for &(t, b) in &extras.logit_bias {
        if let Some(l) = row.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// The log-probability of `token` and of the `top_n` most likely tokens under the softmax of
/// `row` (temperature 1, no filter), computed in f64: `l - max - ln(sum(exp(l - max)))`.
/// NaN and `-inf` logits have probability 0 (log-probability `-inf`) and are never in `top`;
/// `+inf` is clamped to `f32::MAX`, as [`draw`] does. `top` is most likely first, ties by lowest
/// id, and holds `top_n` tokens (fewer only if fewer logits are finite).
pub fn logprobs(row: &[f32], token: Token, top_n: u8) -> TokenLogprob {
    let finite = |l: f32| (l > f32::NEG_INFINITY).then(|| l.min(f32::MAX));
    let max = row
        .iter()
        .filter_map(|&l| finite(l))
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return TokenLogprob {
            logprob: f32::NEG_INFINITY,
            top: vec![],
        };
    }
    let max64 = f64::from(max);
    let sum: f64 = row
        .iter()
        .filter_map(|&l| finite(l))
        .map(|l| (f64::from(l) - max64).exp())
        .sum();
    let log_z = max64 + sum.ln();
    let lp = |l: f32| match finite(l) {
        Some(l) => (f64::from(l) - log_z).min(0.0) as f32,
        None => f32::NEG_INFINITY,
    };
    // The `top_n` best, kept sorted (logit descending, id ascending) while scanning in id order:
    // a later id goes after an equal logit.
    let n = usize::from(top_n);
    let mut best: Vec<(Token, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (id, &l) in row.iter().enumerate() {
            let Some(l) = finite(l) else { continue };
            if best.len() == n && best.last().is_some_and(|&(_, worst)| l <= worst) {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (id as Token, l));
            best.truncate(n);
        }
    }
    TokenLogprob {
        logprob: row
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: best.into_iter().map(|(t, l)| (t, lp(l))).collect(),
    }
}

/// A candidate with its weight relative to the max, and its top-p bucket.
#[derive(Clone, Copy)]
struct Cand {
    id: u32,
    w: f32,
    bucket: u16,
}

/// The argmax over the tokens `ok` accepts; ties go to the lowest id.
fn argmax(logits: &[f32], ok: impl Fn(u32, f32) -> bool) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (id, &l) in logits.iter().enumerate() {
        let id = id as u32;
        if ok(id, l) && best.is_none_or(|(_, b)| l > b) {
            best = Some((id, l));
        }
    }
    best.map(|b| b.0)
}

/// [`argmax`] over every id with `l > -inf` (NaN and `-inf` excluded), lowest id on ties, in two
/// passes the compiler vectorises (the branchy single pass cost a greedy draw ~0.2 ms over a
/// 49,152-token vocabulary; bench/results/profile-2026-12-04.md): the maximum lane by lane, then the first id that holds it.
fn argmax_all(logits: &[f32]) -> Option<u32> {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &l) in lanes.iter_mut().zip(c) {
            // `>` is false for NaN and for `-inf` against the start: neither becomes the max.
            *m = if l > *m { l } else { *m };
        }
    }
    let max = lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    if max == f32::NEG_INFINITY {
        return None;
    }
    // `==` finds the max itself (NaN equals nothing; 0.0 and -0.0 tie, as `>` has them).
    logits.iter().position(|&l| l == max).map(|i| i as u32)
}

/// What [`draw`] returns when nothing survives: the raw argmax (NaN ignored), or 0.
fn fallback(logits: &[f32]) -> u32 {
    argmax(logits, |_, l| !l.is_nan()).unwrap_or(0)
}

/// Value (scaled logit or weight) descending, then id ascending: a total order.
fn cand_desc(a: &Cand, b: &Cand) -> std::cmp::Ordering {
    b.w.total_cmp(&a.w).then(a.id.cmp(&b.id))
}

/// `e^x` for `x` in `[LN_DROP, 0]` (any `x <= 0` works down to about -87), in plain IEEE
/// arithmetic: `2^n * p(f)` with `x * log2(e) = n + f`, `|f| <= 0.5`, and `p` the degree-7 Taylor
/// polynomial of `2^f` (relative error below 1e-8 before rounding; within a few ulp of `expf`).
/// It is used instead of libm's `expf` so that draws are bit-identical on every machine (libm
/// picks its `expf` by CPU features) and because it is several times faster.
#[inline]
pub fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2: f32 = std::f32::consts::LN_2;
    let y = x * LOG2E;
    // y <= 0, so 0.5 - y >= 0.5 truncates to its floor: n = ceil(y - 0.5), f in (-0.5, 0.5].
    let n = -((0.5 - y) as i32);
    let f = (y - n as f32) * LN2;
    // e^f, |f| <= 0.347: Taylor to degree 7 (next term < 2.1e-9).
    let p = 1.0
        + f * (1.0
            + f * (0.5
                + f * (1.0 / 6.0
                    + f * (1.0 / 24.0
                        + f * (1.0 / 120.0 + f * (1.0 / 720.0 + f * (1.0 / 5040.0)))))));
    let scale = f32::from_bits(((n + 127).max(1) as u32) << 23);
    p * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, min_p: f32, top_k: u32, seed: u64) -> Params {
        Params {
            temperature,
            top_p,
            min_p,
            top_k,
            seed,
        }
    }

    /// A reproducible pseudo-random row of logits, roughly like a model's (a few high, most low).
    fn random_logits(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let u = uniform(seed, i as u64) as f32;
                let v = uniform(seed ^ 1, i as u64) as f32;
                // Heavy upper tail: mostly around -5..5, a few up to ~15.
                10.0 * (u - 0.5) + if v > 0.999 { 10.0 } else { 0.0 }
            })
            .collect()
    }

    #[test]
    fn uniform_is_in_range_and_varies() {
        let mut seen = std::collections::HashSet::new();
        for pos in 0..1000 {
            let u = uniform(42, pos);
            assert!((0.0..1.0).contains(&u), "{u}");
            seen.insert(u.to_bits());
        }
        assert_eq!(seen.len(), 1000);
        assert_ne!(uniform(1, 0), uniform(2, 0));
        assert_eq!(uniform(7, 9), uniform(7, 9));
        let mean: f64 = (0..10_000).map(|p| uniform(3, p)).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }

    #[test]
    fn greedy_is_argmax_lowest_id_on_ties() {
        let logits = [1.0, 5.0, 3.0, 5.0, f32::NAN, -2.0];
        let p = params(0.0, 0.9, 0.05, 40, 1);
        for pos in 0..20 {
            assert_eq!(draw(&logits, &p, pos, None), 1);
        }
        let only_odd = |t: u32| t % 2 == 1;
        assert_eq!(draw(&logits, &p, 0, Some(&only_odd)), 1);
        let not_one = |t: u32| t != 1;
        assert_eq!(draw(&logits, &p, 0, Some(&not_one)), 3);
        // Negative and NaN temperatures are greedy too.
        assert_eq!(draw(&logits, &params(-1.0, 1.0, 0.0, 0, 1), 0, None), 1);
        assert_eq!(draw(&logits, &params(f32::NAN, 1.0, 0.0, 0, 1), 0, None), 1);
    }

    #[test]
    fn argmax_all_ties_nan_and_zeros_across_lanes() {
        // 40 ids: two full 16-lane chunks and a remainder of 8.
        let mut row = vec![-1.0f32; 40];
        row[3] = f32::NAN;
        row[5] = -0.0;
        row[21] = 0.0;
        row[37] = 0.0;
        // -0.0 and 0.0 tie: the lowest id, though a later lane holds +0.0.
        assert_eq!(argmax_all(&row), Some(5));
        // The max in the remainder only; NaN never wins.
        row[39] = 2.0;
        assert_eq!(argmax_all(&row), Some(39));
        row[17] = 2.0;
        assert_eq!(argmax_all(&row), Some(17));
        // Nothing above -inf: none.
        let bad: Vec<f32> = (0..33)
            .map(|i| {
                if i % 2 == 0 {
                    f32::NAN
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        assert_eq!(argmax_all(&bad), None);
        // The draw falls back to the raw argmax, NaN ignored: the first -inf.
        assert_eq!(draw(&bad, &params(0.0, 1.0, 0.0, 0, 1), 0, None), 1);
    }

    /// Logits drawn from a few values, so ties, NaN, both infinities and both zeros are common.
    fn tricky_logits() -> impl proptest::strategy::Strategy<Value = Vec<f32>> {
        use proptest::prelude::*;
        let value = prop_oneof![
            Just(f32::NAN),
            Just(f32::NEG_INFINITY),
            Just(f32::INFINITY),
            Just(0.0f32),
            Just(-0.0f32),
            (-3i8..3).prop_map(f32::from),
        ];
        proptest::collection::vec(value, 0..80)
    }

    proptest::proptest! {
        /// The vectorised argmax of the unfiltered draw is the plain one: the lowest id of the
        /// largest value above `-inf`, or none.
        #[test]
        fn argmax_all_is_the_plain_argmax(logits in tricky_logits()) {
            let plain = argmax(&logits, |_, l| l > f32::NEG_INFINITY);
            proptest::prop_assert_eq!(argmax_all(&logits), plain);
        }
    }

    #[test]
    fn nothing_allowed_falls_back_to_the_raw_argmax() {
        let logits = [1.0, 5.0, 3.0];
        let none = |_: u32| false;
        assert_eq!(
            draw(&logits, &params(0.0, 1.0, 0.0, 0, 1), 0, Some(&none)),
            1
        );
        assert_eq!(
            draw(&logits, &params(1.0, 1.0, 0.0, 0, 1), 0, Some(&none)),
            1
        );
        assert_eq!(draw(&[], &params(1.0, 1.0, 0.0, 0, 1), 0, None), 0);
        let all_bad = [f32::NEG_INFINITY, f32::NAN];
        assert_eq!(draw(&all_bad, &params(1.0, 1.0, 0.0, 0, 1), 0, None), 0);
    }

    #[test]
    fn deterministic_for_the_same_inputs() {
        let logits = random_logits(49_152, 5);
        let p = params(0.8, 0.95, 0.02, 0, 1234);
        for pos in 0..50 {
            let a = draw(&logits, &p, pos, None);
            let b = draw(&logits, &p, pos, None);
            assert_eq!(a, b);
        }
    }

    #[test]
    fn different_positions_and_seeds_draw_differently() {
        let logits = vec![0.0f32; 1000]; // uniform over 1000 tokens
        let p = params(1.0, 1.0, 0.0, 0, 99);
        let by_pos: std::collections::HashSet<u32> =
            (0..100).map(|pos| draw(&logits, &p, pos, None)).collect();
        assert!(by_pos.len() > 80, "{}", by_pos.len());
        let by_seed: std::collections::HashSet<u32> = (0..100)
            .map(|seed| draw(&logits, &params(1.0, 1.0, 0.0, 0, seed), 7, None))
            .collect();
        assert!(by_seed.len() > 80, "{}", by_seed.len());
    }

    #[test]
    fn top_k_one_is_greedy() {
        for seed in 0..20 {
            let logits = random_logits(5000, seed);
            let greedy = draw(&logits, &params(0.0, 1.0, 0.0, 0, 0), 0, None);
            for pos in 0..10 {
                let p = params(1.5, 1.0, 0.0, 1, seed);
                assert_eq!(draw(&logits, &p, pos, None), greedy);
            }
        }
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let logits: Vec<f32> = (0..100).map(|i| i as f32 * 0.01).collect(); // 99 is best
        let p = params(5.0, 1.0, 0.0, 3, 11);
        let mut seen = std::collections::HashSet::new();
        for pos in 0..500 {
            let t = draw(&logits, &p, pos, None);
            assert!(t >= 97, "{t}");
            seen.insert(t);
        }
        assert_eq!(seen.len(), 3);
        // Ties at the boundary: lowest ids win.
        let flat = vec![1.0f32; 10];
        for pos in 0..200 {
            assert!(draw(&flat, &params(1.0, 1.0, 0.0, 2, 3), pos, None) < 2);
        }
    }

    #[test]
    fn min_p_excludes_low_tokens() {
        // probabilities ∝ exp(logit): token 0 weight 1, token 1 weight e^-1 ≈ 0.37,
        // token 2 weight e^-3 ≈ 0.05, the rest e^-6 ≈ 0.0025.
        let mut logits = vec![-6.0f32; 50];
        logits[0] = 0.0;
        logits[1] = -1.0;
        logits[2] = -3.0;
        let p = params(1.0, 1.0, 0.1, 0, 5);
        let mut counts = [0u32; 3];
        for pos in 0..4000 {
            let t = draw(&logits, &p, pos, None);
            assert!(t < 2, "min_p 0.1 let through token {t}");
            counts[t as usize] += 1;
        }
        // Renormalised over {0, 1}: 1 / (1 + e^-1) ≈ 0.731.
        let frac = counts[0] as f64 / 4000.0;
        assert!((frac - 0.731).abs() < 0.03, "{frac}");
        // Without min_p the tail is drawn now and then.
        let free = params(1.0, 1.0, 0.0, 0, 5);
        assert!((0..4000).any(|pos| draw(&logits, &free, pos, None) >= 2));
    }

    #[test]
    fn top_p_excludes_low_tokens() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0, 1} (0.5 + 0.3 >= 0.75).
        let probs = [0.5f32, 0.3, 0.15, 0.05];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let p = params(1.0, 0.75, 0.0, 0, 8);
        let mut counts = [0u32; 4];
        for pos in 0..4000 {
            counts[draw(&logits, &p, pos, None) as usize] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
        let frac = counts[0] as f64 / 4000.0;
        assert!((frac - 0.625).abs() < 0.03, "{frac}");
        // top_p 0 keeps only the most likely token.
        let p0 = params(1.0, 0.0, 0.0, 0, 8);
        assert!((0..200).all(|pos| draw(&logits, &p0, pos, None) == 0));
    }

    #[test]
    fn top_p_needing_the_tail_is_exact() {
        // One strong token and a huge flat tail below the 1e-6 sort head: top_p 0.999 must reach
        // into the tail, which is sorted only then.
        let mut logits = vec![-15.0f32; 49_152];
        logits[123] = 0.0;
        let p = params(1.0, 0.999, 0.0, 0, 17);
        let tail = (0..2000)
            .filter(|&pos| draw(&logits, &p, pos, None) != 123)
            .count();
        // Mass of the tail: 49151 * e^-15 / (1 + 49151 * e^-15) ≈ 0.0149; top_p 0.999 keeps
        // nearly all of it (the cut happens deep in the tail).
        let frac = tail as f64 / 2000.0;
        assert!(frac > 0.005 && frac < 0.03, "{frac}");
    }

    #[test]
    fn distribution_matches_softmax() {
        let logits = [0.0f32, 0.5, 1.0, -1.0, 2.0, 0.2];
        let temp = 0.7f32;
        let weights: Vec<f64> = logits.iter().map(|&l| ((l / temp) as f64).exp()).collect();
        let z: f64 = weights.iter().sum();
        let n = 20_000u64;
        let p = params(temp, 1.0, 0.0, 0, 2024);
        let mut counts = [0u64; 6];
        for pos in 0..n {
            counts[draw(&logits, &p, pos, None) as usize] += 1;
        }
        let chi2: f64 = counts
            .iter()
            .zip(&weights)
            .map(|(&c, &w)| {
                let e = n as f64 * w / z;
                (c as f64 - e).powi(2) / e
            })
            .sum();
        // 5 degrees of freedom: p = 0.001 at 20.5.
        assert!(chi2 < 20.5, "chi2 {chi2}, counts {counts:?}");
    }

    #[test]
    fn allowed_restricts_sampling() {
        let logits = random_logits(1000, 3);
        let even = |t: u32| t % 2 == 0;
        let p = params(1.0, 0.95, 0.0, 40, 1);
        for pos in 0..300 {
            assert_eq!(draw(&logits, &p, pos, Some(&even)) % 2, 0);
        }
    }

    fn extras(presence: f32, frequency: f32, bias: Vec<(u32, f32)>) -> SampleExtras {
        SampleExtras {
            presence_penalty: presence,
            frequency_penalty: frequency,
            logit_bias: bias,
            logprobs: None,
        }
    }

    #[test]
    fn extras_penalize_and_bias_as_openai_says() {
        let row = [1.0f32, 2.0, 3.0, 0.5, 4.0];
        let counts = [(2u32, 3u32), (0, 1), (1, 0), (99, 5)];
        let x = extras(0.5, 0.25, vec![(3, 10.0), (1, -1.0), (3, 0.5)]);
        let mut got = row;
        apply_extras(&mut got, &x, counts);
        // 0: 1 - (0.5 + 0.25*1); 1: count 0, bias -1; 2: 3 - (0.5 + 0.25*3); 3: 0.5 + 10 + 0.5.
        assert_eq!(got, [0.25, 1.0, 1.75, 11.0, 4.0]);
        assert_eq!(draw(&got, &params(0.0, 1.0, 0.0, 0, 1), 0, None), 3);
        // Negative penalties encourage repeats.
        let mut got = row;
        apply_extras(&mut got, &extras(-1.0, -0.5, vec![]), counts);
        assert_eq!(got, [2.5, 2.0, 5.5, 0.5, 4.0]);
        // No penalty: the counts are not even read; no bias: nothing changes.
        let mut got = row;
        apply_extras(&mut got, &extras(0.0, 0.0, vec![]), counts);
        assert_eq!(got, row);
        // The order of the counts does not matter.
        let (mut a, mut b) = (row, row);
        apply_extras(&mut a, &x, counts);
        apply_extras(&mut b, &x, counts.iter().rev().copied());
        assert_eq!(a, b);
    }

    /// log-softmax in f64, the slow obvious way.
    fn log_softmax(row: &[f32]) -> Vec<f64> {
        let z: f64 = row.iter().map(|&l| f64::from(l).exp()).sum();
        row.iter().map(|&l| f64::from(l) - z.ln()).collect()
    }

    #[test]
    fn logprob_of_the_greedy_pick_is_its_log_softmax() {
        let row = [0.5f32, 2.0, -1.0, 1.5, 2.0, 0.0];
        let want = log_softmax(&row);
        let pick = draw(&row, &params(0.0, 1.0, 0.0, 0, 1), 0, None);
        assert_eq!(pick, 1);
        let got = logprobs(&row, pick, 3);
        assert!((f64::from(got.logprob) - want[1]).abs() < 1e-6, "{got:?}");
        assert!(got.logprob < 0.0);
        // The top 3: the tie at 2.0 goes to the lower id, then 1.5.
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 4, 3]);
        for (t, lp) in &got.top {
            assert!((f64::from(*lp) - want[*t as usize]).abs() < 1e-6);
        }
        // A row far from zero (large logits) gives the same answer: nothing overflows.
        let shifted: Vec<f32> = row.iter().map(|l| l + 1000.0).collect();
        let far = logprobs(&shifted, 1, 0);
        assert!((f64::from(far.logprob) - want[1]).abs() < 1e-4, "{far:?}");
        assert!(far.top.is_empty());
        // The probabilities sum to 1.
        let total: f64 = (0..row.len() as u32)
            .map(|t| f64::from(logprobs(&row, t, 0).logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
    }

    #[test]
    fn top_logprobs_are_most_likely_first_and_as_many_as_asked() {
        let row = random_logits(5000, 21);
        let mut sorted: Vec<(u32, f32)> = row
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for n in [0u8, 1, 5, 20] {
            let got = logprobs(&row, sorted[0].0, n);
            assert_eq!(got.top.len(), usize::from(n));
            let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
            let want: Vec<u32> = sorted[..usize::from(n)].iter().map(|t| t.0).collect();
            assert_eq!(ids, want);
            assert!(got.top.windows(2).all(|w| w[0].1 >= w[1].1));
            if n > 0 {
                assert_eq!(got.top[0].1, got.logprob);
            }
        }
        // Ties: lowest ids first. Excluded logits are never listed, so fewer come back.
        let flat = [1.0f32, f32::NAN, 1.0, f32::NEG_INFINITY, 1.0];
        let got = logprobs(&flat, 3, 5);
        assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 2, 4]);
        assert_eq!(got.logprob, f32::NEG_INFINITY);
        assert!((got.top[0].1 - (1.0f32 / 3.0).ln()).abs() < 1e-6);
        assert!(logprobs(&[], 0, 3).top.is_empty());
    }

    #[test]
    fn exp_neg_matches_exp() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x >= LN_DROP - 1.0 {
            let got = f64::from(exp_neg(x));
            let want = f64::from(x).exp();
            worst = worst.max((got - want).abs() / want);
            x -= 0.000_37;
        }
        assert!(worst < 1e-6, "relative error {worst}");
        assert_eq!(exp_neg(0.0), 1.0);
    }

    #[test]
    fn a_full_vocabulary_samples_fast() {
        let logits = random_logits(49_152, 77);
        let flat = vec![0.0f32; 49_152]; // the worst case: every token survives every filter
        let cases = [
            (&logits, params(0.8, 0.95, 0.05, 40, 1)),
            (&logits, params(1.0, 0.9, 0.0, 0, 1)),
            (&logits, params(1.0, 1.0, 0.0, 0, 1)),
            (&flat, params(1.0, 0.9, 0.0, 0, 1)),
            (&flat, params(1.0, 1.0, 0.0, 0, 1)),
            (&logits, params(0.0, 1.0, 0.0, 0, 1)),
        ];
        for (row, p) in cases {
            // The median of single draws: robust to the test being preempted now and then.
            let mut times: Vec<std::time::Duration> = (0..21u64)
                .map(|pos| {
                    let start = std::time::Instant::now();
                    std::hint::black_box(draw(row, &p, pos, None));
                    start.elapsed()
                })
                .collect();
            times.sort();
            let per = times[times.len() / 2];
            eprintln!("{p:?}: {per:?} per draw (median)");
            assert!(
                per < std::time::Duration::from_millis(2),
                "{p:?}: {per:?} per draw"
            );
        }
    }
}

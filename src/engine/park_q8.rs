//! `--park-lossy`: a sequence's KV state stored with its f16 K and V rows
//! as Q8_0 blocks (ggml's: 32 values, one f16 scale and 32 signed bytes, 34
//! bytes for 64), about half the size, and expanded back to f16 before it is
//! restored. The live cache stays f16 (the spec: "implies --kv-bits 16"); the
//! restored values differ from the sealed ones by at most half a step of
//! their block's scale.
//!
//! llama.cpp's sequence state is opaque bytes; this reads the layout it
//! writes (`engine::seq_state`) strictly: every count bounded, every size
//! consistent, and the whole buffer consumed. A state it does not recognise (another
//! layout, cells with extra position data, a type other than f16) is stored
//! as it is: never smaller than it could be, never wrong.
//!
//! The stored form: `SFQ8`, the state's length, and segments, each raw
//! bytes copied as they are or an f16 region as Q8_0 blocks.

use std::ops::Range;

use half::f16;

use super::seq_state::{Reader, MAX_CELLS, MAX_LAYERS, MAX_SEQ_IDS, MAX_STREAMS, STATE_MAGIC};

const MAGIC: &[u8; 4] = b"SFQ8";
/// ggml's type id of f16.
const GGML_F16: i32 = 1;
/// Values in a Q8_0 block.
const BLOCK: usize = 32;
/// Bytes of a Q8_0 block: the f16 scale and 32 signed bytes.
const BLOCK_BYTES: usize = 2 + BLOCK;
const RAW: u8 = 0;
const Q8: u8 = 1;

/// A data region of `len` bytes, kept as f16 when its type says so.
fn region(r: &mut Reader, ty: i32, len: u64, out: &mut Vec<Range<usize>>) -> Option<()> {
    let got = r.take(usize::try_from(len).ok()?)?;
    if ty == GGML_F16 && got.len() % 2 == 0 && !got.is_empty() {
        out.push(got);
    }
    Some(())
}

/// The f16 regions of a sequence state, in order; None when the layout is
/// not the one this build knows.
fn f16_regions(state: &[u8]) -> Option<Vec<Range<usize>>> {
    let mut r = Reader::new(state);
    let mut out = Vec::new();
    if r.u32()? != STATE_MAGIC {
        return None;
    }
    let _seq_id = r.i32()?;
    let n_stream = r.u32()?;
    if n_stream == 0 || n_stream > MAX_STREAMS {
        return None;
    }
    for _ in 0..n_stream {
        let cells = r.u32()?;
        if cells == 0 {
            continue;
        }
        if cells > MAX_CELLS {
            return None;
        }
        for _ in 0..cells {
            let _pos = r.i32()?;
            let n_seq = r.u32()?;
            if n_seq == 0 || n_seq > MAX_SEQ_IDS {
                return None;
            }
            r.take(4 * n_seq as usize)?;
        }
        let v_trans = r.u32()?;
        let n_layer = r.u32()?;
        if v_trans > 1 || n_layer == 0 || n_layer > MAX_LAYERS {
            return None;
        }
        let (_n_rot_k, _n_rot_v) = (r.u32()?, r.u32()?);
        let cells = u64::from(cells);
        for _ in 0..n_layer {
            let ty = r.i32()?;
            let row = r.u64()?;
            region(&mut r, ty, row.checked_mul(cells)?, &mut out)?;
        }
        for _ in 0..n_layer {
            let ty = r.i32()?;
            if v_trans == 0 {
                let row = r.u64()?;
                region(&mut r, ty, row.checked_mul(cells)?, &mut out)?;
            } else {
                let el = u64::from(r.u32()?);
                let n_embd = u64::from(r.u32()?);
                region(
                    &mut r,
                    ty,
                    n_embd.checked_mul(cells)?.checked_mul(el)?,
                    &mut out,
                )?;
            }
        }
    }
    (r.at == state.len()).then_some(out)
}

fn quantize_region(bytes: &[u8], out: &mut Vec<u8>) {
    for chunk in bytes.chunks(2 * BLOCK) {
        let mut x = [0f32; BLOCK];
        for (v, h) in x.iter_mut().zip(chunk.chunks_exact(2)) {
            *v = f16::from_le_bytes([h[0], h[1]]).to_f32();
        }
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(
            x.iter()
                .map(|v| (v * id).round().clamp(-127.0, 127.0) as i8 as u8),
        );
    }
}

/// The stored form of `state`, its f16 regions as Q8_0; None when its
/// layout is not recognised (store it as it is).
pub fn quantize(state: &[u8]) -> Option<Vec<u8>> {
    let regions = f16_regions(state)?;
    if regions.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(state.len() / 2 + 64);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(state.len() as u64).to_le_bytes());
    let mut segments = Vec::new();
    let mut at = 0;
    for r in &regions {
        if r.start > at {
            segments.push((RAW, at..r.start));
        }
        segments.push((Q8, r.clone()));
        at = r.end;
    }
    if at < state.len() {
        segments.push((RAW, at..state.len()));
    }
    out.extend_from_slice(&(segments.len() as u32).to_le_bytes());
    for (kind, r) in segments {
        out.push(kind);
        let bytes = &state[r];
        if kind == RAW {
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(bytes);
        } else {
            out.extend_from_slice(&((bytes.len() / 2) as u64).to_le_bytes());
            quantize_region(bytes, &mut out);
        }
    }
    Some(out)
}

/// The f16 state back from its stored form; Err naming what is wrong with
/// a stored form this build did not write.
pub fn dequantize(stored: &[u8]) -> Result<Vec<u8>, String> {
    let bad = |what: &str| format!("the lossy park state is malformed: {what}");
    let mut r = Reader::new(stored);
    let magic = r.take(4).ok_or_else(|| bad("too short"))?;
    if &stored[magic] != MAGIC {
        return Err(bad("bad magic"));
    }
    let len = r.u64().ok_or_else(|| bad("too short"))?;
    // The expanded state is at most twice the stored one (plus headers):
    // checked before anything is allocated.
    if len > 2 * stored.len() as u64 + 1024 {
        return Err(bad("a length past what it can hold"));
    }
    let n = r.u32().ok_or_else(|| bad("too short"))?;
    let mut out = Vec::with_capacity(len as usize);
    for _ in 0..n {
        let kind = r
            .take(1)
            .map(|k| stored[k.start])
            .ok_or_else(|| bad("a cut segment"))?;
        let count = r.u64().ok_or_else(|| bad("a cut segment"))?;
        match kind {
            RAW => {
                let b = r
                    .take(usize::try_from(count).map_err(|_| bad("a raw segment's length"))?)
                    .ok_or_else(|| bad("a cut raw segment"))?;
                out.extend_from_slice(&stored[b]);
            }
            Q8 => {
                let values = usize::try_from(count).map_err(|_| bad("a region's length"))?;
                let blocks = values.div_ceil(BLOCK);
                let b = r
                    .take(
                        blocks
                            .checked_mul(BLOCK_BYTES)
                            .ok_or_else(|| bad("a region's length"))?,
                    )
                    .ok_or_else(|| bad("a cut region"))?;
                let mut left = values;
                for block in stored[b].chunks_exact(BLOCK_BYTES) {
                    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                    for &q in &block[2..2 + left.min(BLOCK)] {
                        out.extend_from_slice(&f16::from_f32(f32::from(q as i8) * d).to_le_bytes());
                    }
                    left = left.saturating_sub(BLOCK);
                }
            }
            _ => return Err(bad("an unknown segment kind")),
        }
        if out.len() as u64 > len {
            return Err(bad("more bytes than its length"));
        }
    }
    if r.at != stored.len() || out.len() as u64 != len {
        return Err(bad("its length does not add up"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state in llama.cpp's layout: one stream, `cells` cells of sequence
    /// 0, `layers` layers of `n_embd` f16 values, V transposed or not.
    fn state(cells: u32, layers: u32, n_embd: u32, v_trans: bool) -> (Vec<u8>, Vec<f32>) {
        let mut b = Vec::new();
        let mut values = Vec::new();
        let mut next = 0u32;
        let mut f16s = |b: &mut Vec<u8>, n: u32| {
            for _ in 0..n {
                next += 1;
                let v = ((next * 37 % 101) as f32 - 50.0) / 17.0;
                values.push(f16::from_f32(v).to_f32());
                b.extend_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        };
        b.extend_from_slice(&STATE_MAGIC.to_le_bytes());
        b.extend_from_slice(&3i32.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&cells.to_le_bytes());
        for c in 0..cells {
            b.extend_from_slice(&(c as i32).to_le_bytes());
            b.extend_from_slice(&1u32.to_le_bytes());
            b.extend_from_slice(&0i32.to_le_bytes());
        }
        b.extend_from_slice(&u32::from(v_trans).to_le_bytes());
        b.extend_from_slice(&layers.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        for _ in 0..layers {
            b.extend_from_slice(&GGML_F16.to_le_bytes());
            b.extend_from_slice(&u64::from(2 * n_embd).to_le_bytes());
            f16s(&mut b, n_embd * cells);
        }
        for _ in 0..layers {
            b.extend_from_slice(&GGML_F16.to_le_bytes());
            if v_trans {
                b.extend_from_slice(&2u32.to_le_bytes());
                b.extend_from_slice(&n_embd.to_le_bytes());
            } else {
                b.extend_from_slice(&u64::from(2 * n_embd).to_le_bytes());
            }
            f16s(&mut b, n_embd * cells);
        }
        (b, values)
    }

    fn f16_values(bytes: &[u8], regions: &[Range<usize>]) -> Vec<f32> {
        regions
            .iter()
            .flat_map(|r| {
                bytes[r.clone()]
                    .chunks_exact(2)
                    .map(|h| f16::from_le_bytes([h[0], h[1]]).to_f32())
            })
            .collect()
    }

    #[test]
    fn a_state_comes_back_within_a_q8_step_at_about_half_the_size() {
        for v_trans in [false, true] {
            let (s, values) = state(37, 3, 48, v_trans);
            let regions = f16_regions(&s).expect("the layout is recognised");
            assert_eq!(regions.len(), 6);
            let q = quantize(&s).unwrap();
            let ratio = q.len() as f64 / s.len() as f64;
            assert!((0.5..0.6).contains(&ratio), "ratio {ratio}");
            let back = dequantize(&q).unwrap();
            assert_eq!(back.len(), s.len());
            // Everything but the values is byte for byte the same.
            let mut at = 0;
            for r in &regions {
                assert_eq!(back[at..r.start], s[at..r.start]);
                at = r.end;
            }
            assert_eq!(back[at..], s[at..]);
            let got = f16_values(&back, &regions);
            assert_eq!(got.len(), values.len());
            let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (g, v) in got.iter().zip(&values) {
                assert!((g - v).abs() <= amax / 127.0, "{g} vs {v}");
            }
        }
    }

    #[test]
    fn a_layout_it_does_not_know_is_stored_as_it_is() {
        let (mut s, _) = state(4, 2, 32, false);
        // One byte more than the layout accounts for.
        s.push(0);
        assert!(quantize(&s).is_none());
        // A type other than f16 (q8_0 = 8) is not quantized again.
        let (mut s, _) = state(4, 1, 32, false);
        let k_type_at = 8 + 4 + 4 + 4 * 12 + 16;
        s[k_type_at..k_type_at + 4].copy_from_slice(&8i32.to_le_bytes());
        let regions = f16_regions(&s).unwrap();
        assert_eq!(regions.len(), 1, "only V is f16");
        assert!(quantize(&[]).is_none());
        assert!(quantize(&[1, 0, 0, 0]).is_none());
        // Another magic: not a state this build knows.
        let (mut s, _) = state(4, 1, 32, false);
        s[0] ^= 1;
        assert!(quantize(&s).is_none());
    }

    #[test]
    fn a_malformed_stored_form_is_an_error_never_a_panic() {
        let (s, _) = state(5, 2, 40, true);
        let q = quantize(&s).unwrap();
        for cut in [0, 3, 4, 12, 16, 17, q.len() / 2, q.len() - 1] {
            assert!(dequantize(&q[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = q.clone();
        longer.push(0);
        assert!(dequantize(&longer).is_err());
        let mut huge = q.clone();
        huge[4..12].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(dequantize(&huge).is_err());
        let mut kind = q.clone();
        kind[16] = 9;
        assert!(dequantize(&kind).is_err());
    }
}

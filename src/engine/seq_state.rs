//! llama.cpp's per-sequence state, read as bytes: the layout
//! `llama_context::state_seq_get_data` writes (its magic and the sequence
//! id, then `llama_kv_cache::state_write`: the stream count, then per
//! stream the cell count, each cell's position and sequence ids, then
//! `v_trans`, the layer count, `n_rot_k`, `n_rot_v`, and per layer the K
//! rows, then the V rows or, transposed, the V columns, each region after
//! its type and sizes), read strictly: every count bounded, every size
//! consistent, the whole buffer consumed. A state in another layout (cells
//! with extra position data, more than one stream) is not recognised, and
//! the callers then use it whole.
//!
//! - [`prefix`]: the state of a sequence's first positions alone, so the
//!   host-memory tier imports only the part of a stored conversation a
//!   prompt shares (`KvRestore` with `keep`).
//! - [`Reader`]: the bounded cursor `park_q8` reads the same layout with.

use std::ops::Range;

/// What llama.cpp's `state_seq_get_data` writes first (its `io_magic`),
/// before the sequence id and the KV cache's part.
pub const STATE_MAGIC: u32 = 0xaf14_3cd8;

/// Bounds of the layout reader: more is not a state this build wrote.
pub const MAX_STREAMS: u32 = 256;
pub const MAX_CELLS: u32 = 1 << 24;
pub const MAX_SEQ_IDS: u32 = 1 << 16;
pub const MAX_LAYERS: u32 = 4096;

/// A cursor over the state that fails rather than reads past its end.
pub struct Reader<'a> {
    pub b: &'a [u8],
    pub at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(b: &'a [u8]) -> Reader<'a> {
        Reader { b, at: 0 }
    }

    pub fn take(&mut self, n: usize) -> Option<Range<usize>> {
        let end = self.at.checked_add(n)?;
        if end > self.b.len() {
            return None;
        }
        let r = self.at..end;
        self.at = end;
        Some(r)
    }

    pub fn u32(&mut self) -> Option<u32> {
        let r = self.take(4)?;
        Some(u32::from_le_bytes(self.b[r].try_into().ok()?))
    }

    pub fn i32(&mut self) -> Option<i32> {
        self.u32().map(|v| v as i32)
    }

    pub fn u64(&mut self) -> Option<u64> {
        let r = self.take(8)?;
        Some(u64::from_le_bytes(self.b[r].try_into().ok()?))
    }
}

/// The state of the cells at positions `0..n` alone: the same layout with
/// only those cells, their rows and their V columns. None when the layout
/// is not recognised (one stream, one sequence id a cell) or no cell is
/// below `n`.
pub fn prefix(state: &[u8], n: u32) -> Option<Vec<u8>> {
    let mut r = Reader::new(state);
    let mut out = Vec::new();
    let head = r.take(8)?; // the magic and the sequence id
    if u32::from_le_bytes(state[head.start..head.start + 4].try_into().ok()?) != STATE_MAGIC {
        return None;
    }
    out.extend_from_slice(&state[head]);
    if r.u32()? != 1 {
        return None;
    }
    out.extend_from_slice(&1u32.to_le_bytes());
    let cells = r.u32()?;
    if cells == 0 || cells > MAX_CELLS {
        return None;
    }
    // Each cell: its position, one sequence id.
    let meta = r.take(12 * cells as usize)?;
    let keep: Vec<bool> = state[meta.clone()]
        .chunks_exact(12)
        .map(|c| {
            let pos = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let n_seq = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
            (n_seq == 1).then_some(pos >= 0 && (pos as u32) < n)
        })
        .collect::<Option<_>>()?;
    let kept = keep.iter().filter(|&&k| k).count();
    if kept == 0 {
        return None;
    }
    out.extend_from_slice(&(kept as u32).to_le_bytes());
    for (c, _) in state[meta].chunks_exact(12).zip(&keep).filter(|(_, &k)| k) {
        out.extend_from_slice(c);
    }
    let v_trans = r.u32()?;
    let n_layer = r.u32()?;
    if v_trans > 1 || n_layer == 0 || n_layer > MAX_LAYERS {
        return None;
    }
    let rot = r.take(8)?; // n_rot_k, n_rot_v
    out.extend_from_slice(&v_trans.to_le_bytes());
    out.extend_from_slice(&n_layer.to_le_bytes());
    out.extend_from_slice(&state[rot]);
    // `rows` units of `cells` consecutive items of `item` bytes each: the
    // kept cells' items of each.
    let items = |r: &mut Reader, out: &mut Vec<u8>, rows: u64, item: u64| -> Option<()> {
        let item = usize::try_from(item).ok().filter(|&i| i > 0)?;
        let len = rows
            .checked_mul(u64::from(cells))?
            .checked_mul(item as u64)?;
        let data = r.take(usize::try_from(len).ok()?)?;
        for unit in state[data].chunks_exact(item * cells as usize) {
            for (x, _) in unit.chunks_exact(item).zip(&keep).filter(|(_, &k)| k) {
                out.extend_from_slice(x);
            }
        }
        Some(())
    };
    for _ in 0..n_layer {
        let sizes = r.take(12)?; // the type, the row's bytes
        out.extend_from_slice(&state[sizes.clone()]);
        let row = u64::from_le_bytes(state[sizes.start + 4..sizes.end].try_into().ok()?);
        items(&mut r, &mut out, 1, row)?;
    }
    for _ in 0..n_layer {
        if v_trans == 0 {
            let sizes = r.take(12)?;
            out.extend_from_slice(&state[sizes.clone()]);
            let row = u64::from_le_bytes(state[sizes.start + 4..sizes.end].try_into().ok()?);
            items(&mut r, &mut out, 1, row)?;
        } else {
            // The type, each element's bytes, the embedding size; then
            // for each of its values, every cell's.
            let sizes = r.take(12)?;
            out.extend_from_slice(&state[sizes.clone()]);
            let b = &state[sizes];
            let el = u64::from(u32::from_le_bytes(b[4..8].try_into().ok()?));
            let n_embd = u64::from(u32::from_le_bytes(b[8..12].try_into().ok()?));
            items(&mut r, &mut out, n_embd, el)?;
        }
    }
    (r.at == state.len()).then_some(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A state in llama.cpp's layout: one stream, a cell for each
    /// (position, label) of `cells`, `layers` layers of `n_embd` 2-byte
    /// values, each value naming its layer, K or V, its cell's label and its
    /// index.
    pub(crate) fn state(cells: &[(i32, u32)], layers: u32, n_embd: u32, v_trans: bool) -> Vec<u8> {
        let value = |layer: u32, v: u32, label: u32, i: u32| -> [u8; 2] {
            ((((layer * 2 + v) * 64 + label) as u16) ^ ((i as u16) << 9)).to_le_bytes()
        };
        let mut b = Vec::new();
        b.extend_from_slice(&STATE_MAGIC.to_le_bytes());
        b.extend_from_slice(&3i32.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&(cells.len() as u32).to_le_bytes());
        for &(p, _) in cells {
            b.extend_from_slice(&p.to_le_bytes());
            b.extend_from_slice(&1u32.to_le_bytes());
            b.extend_from_slice(&3i32.to_le_bytes());
        }
        b.extend_from_slice(&u32::from(v_trans).to_le_bytes());
        b.extend_from_slice(&layers.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        for l in 0..layers {
            b.extend_from_slice(&1i32.to_le_bytes());
            b.extend_from_slice(&u64::from(2 * n_embd).to_le_bytes());
            for &(_, c) in cells {
                for i in 0..n_embd {
                    b.extend_from_slice(&value(l, 0, c, i));
                }
            }
        }
        for l in 0..layers {
            b.extend_from_slice(&1i32.to_le_bytes());
            if v_trans {
                b.extend_from_slice(&2u32.to_le_bytes());
                b.extend_from_slice(&n_embd.to_le_bytes());
                for i in 0..n_embd {
                    for &(_, c) in cells {
                        b.extend_from_slice(&value(l, 1, c, i));
                    }
                }
            } else {
                b.extend_from_slice(&u64::from(2 * n_embd).to_le_bytes());
                for &(_, c) in cells {
                    for i in 0..n_embd {
                        b.extend_from_slice(&value(l, 1, c, i));
                    }
                }
            }
        }
        b
    }

    fn labelled(positions: &[i32]) -> Vec<(i32, u32)> {
        positions.iter().zip(0..).map(|(&p, c)| (p, c)).collect()
    }

    #[test]
    fn a_prefix_is_the_state_of_the_cells_below_it() {
        for v_trans in [false, true] {
            // Cells in cache order, not position order (a sequence whose
            // cells filled holes): the prefix keeps those below 4, in the
            // same order, with their own K rows and V values.
            let cells = labelled(&[0, 1, 5, 2, 6, 3, 4]);
            let whole = state(&cells, 3, 8, v_trans);
            let kept: Vec<(i32, u32)> = cells.iter().copied().filter(|&(p, _)| p < 4).collect();
            assert_eq!(kept.len(), 4);
            assert_eq!(
                prefix(&whole, 4).expect("recognised"),
                state(&kept, 3, 8, v_trans),
                "v_trans {v_trans}"
            );
        }
    }

    #[test]
    fn a_prefix_of_everything_is_the_state_itself() {
        let whole = state(&labelled(&[0, 1, 2]), 2, 4, true);
        assert_eq!(prefix(&whole, 3).unwrap(), whole);
        assert_eq!(prefix(&whole, 100).unwrap(), whole);
    }

    #[test]
    fn what_is_not_recognised_gives_no_prefix() {
        let whole = state(&labelled(&[0, 1, 2]), 2, 4, false);
        // No cell below 0; a cut buffer; a trailing byte; another magic.
        assert!(prefix(&whole, 0).is_none());
        assert!(prefix(&whole[..whole.len() - 1], 2).is_none());
        let mut longer = whole.clone();
        longer.push(0);
        assert!(prefix(&longer, 2).is_none());
        let mut other = whole.clone();
        other[0] ^= 1;
        assert!(prefix(&other, 2).is_none());
        // Two sequence ids on a cell.
        let mut shared = whole;
        shared[20..24].copy_from_slice(&2u32.to_le_bytes());
        assert!(prefix(&shared, 2).is_none());
    }
}

#!/usr/bin/env python3
"""How many tiles ggml's tiled CPU flash attention computes (issue 12).

ggml's prefill kernel (`ggml_compute_forward_flash_attn_ext_tiled`, llama.cpp
b11434 and llama-cpp-sys-2 0.1.161) walks the batch's query rows in tiles of
64 and the KV cells up to `n_kv` in tiles of 64, and skips a (query tile, KV
tile) pair only when every query row of the tile is masked from every cell of
it; any other pair is computed whole. This counts the computed pairs (per
head and layer) for bench.py's concurrent workload, as the two servers lay it
out:

- superfluid: one unified cache; a 13-token shared opening of the system
  prompt in cells 0-12 (restored for every session), then the first prompt
  alone (206 new tokens), then the other three in steps of 512 and the rest,
  each sequence's cells after the one before (what llama.cpp's cache log
  showed, docs/benchmarks.md);
- llama-server: one stream per slot, each 219-token prompt in its own cells
  from 0.

    python3 bench/peer/fa_tiles.py

A tile holds query rows of two sequences when a step's rows cross from one
prompt to the next, a sequence's cells start mid-tile when the cells before
it are not a multiple of 64, and the shared opening's tile is computed for
every query tile of every sequence: the unified layout computes about 1.5x
the pairs. Two more rows show what decoding one prompt per call, and also
placing each sequence's cells at a multiple of 64, would leave.

The last column counts the work of superfluid's kernel (ggml-patch/), which
computes in each such pair only the rows that see any of its cells and the
cells, in steps of 16, that any row sees: in pairs' worth of scores (rows x
cells / 4,096). llama-server runs ggml's kernel, every pair whole.
"""

import argparse

TILE = 64
PROMPT = 219
SHARED = 13
STEP = 512


def padded(n):
    """llama.cpp's n_kv: the cells in use, padded to 256."""
    return max(256, -(-n // 256) * 256)


def computed(rows, cells):
    """Computed (query tile, KV tile) pairs for `rows` [(seq, pos)] over
    `cells` [(seqs, pos)], n_kv the padded count of cells."""
    n = 0
    for q in range(0, len(rows), TILE):
        tile = rows[q:q + TILE]
        for c in range(0, padded(len(cells)), TILE):
            n += any(s in seqs and cp <= p
                     for s, p in tile for seqs, cp in cells[c:c + TILE])
    return n


CELL_STEP = 16


def trimmed(rows, cells):
    """The scores superfluid's kernel computes for the same pairs, in pairs'
    worth: per pair, the span of rows that see any cell times the span of
    cells (rounded out to steps of 16) any row sees."""
    n = 0
    for q in range(0, len(rows), TILE):
        tile = rows[q:q + TILE]
        for c in range(0, padded(len(cells)), TILE):
            block = cells[c:c + TILE]
            seen = [(i, j) for i, (s, p) in enumerate(tile)
                    for j, (seqs, cp) in enumerate(block) if s in seqs and cp <= p]
            if not seen:
                continue
            r = max(i for i, _ in seen) - min(i for i, _ in seen) + 1
            c0 = min(j for _, j in seen) // CELL_STEP * CELL_STEP
            c1 = -(-(max(j for _, j in seen) + 1) // CELL_STEP) * CELL_STEP
            n += r * (c1 - c0) / (TILE * TILE)
    return n


def unified(steps, aligned=False):
    """(pairs ggml computes, superfluid's kernel's work in pairs' worth)."""
    cells = [({1, 2, 3, 4}, p) for p in range(SHARED)]
    total, trim = 0, 0.0
    for rows in steps:
        if aligned:
            while len(cells) % TILE:
                cells.append((set(), -1))
        cells.extend(({s}, p) for s, p in rows)
        total += computed(rows, cells)
        trim += trimmed(rows, cells)
    return total, trim


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    prompt = {s: [(s, p) for p in range(SHARED, PROMPT)] for s in (1, 2, 3, 4)}
    rest = prompt[2] + prompt[3] + prompt[4]
    rows = [
        ("superfluid (unified, as it runs)",
         unified([prompt[1], rest[:STEP], rest[STEP:]])),
        ("superfluid, one prompt per decode call",
         unified([prompt[1], prompt[2], prompt[3], prompt[4]])),
        ("superfluid, one prompt per call, cells at multiples of 64",
         unified([prompt[1], prompt[2], prompt[3], prompt[4]], aligned=True)),
    ]
    streams = 0
    for s in (1, 2, 3, 4):
        own = [(s, p) for p in range(PROMPT)]
        streams += computed(own, [({s}, p) for _, p in own])
    rows.append(("llama-server (a stream per slot)", (streams, None)))
    print("| layout | computed tile pairs per head and layer | against llama-server "
          "| superfluid's kernel, pairs' worth | against llama-server |")
    print("|---|---:|---:|---:|---:|")
    for name, (n, trim) in rows:
        t = f"{trim:.1f} | {trim / streams:.2f}" if trim is not None else "| "
        print(f"| {name} | {n} | {n / streams:.2f} | {t} |")


if __name__ == "__main__":
    main()

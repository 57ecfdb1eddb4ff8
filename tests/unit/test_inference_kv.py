"""KV-cache surgery of BatchKVLayer against a plain reference (cat / index_select / pad)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from services.inference.engine import KV_SPARE_COLUMNS, BatchKVLayer

HEADS, DIM = 2, 4


def filled(rows: int, length: int, gen: torch.Generator) -> tuple[BatchKVLayer, torch.Tensor, torch.Tensor]:
    layer = BatchKVLayer()
    keys, values = (
        torch.randn(rows, HEADS, length, DIM, generator=gen),
        torch.randn(rows, HEADS, length, DIM, generator=gen),
    )
    layer.update(keys, values)
    return layer, keys, values


def test_surgery_matches_a_plain_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    layer, ref_k, ref_v = filled(2, 5, gen)
    for _ in range(300):
        op = rng.choice(["step", "step", "join", "drop", "trim"])
        rows, length = ref_k.shape[0], ref_k.shape[2]
        if op == "step":
            k, v = torch.randn(rows, HEADS, 1, DIM, generator=gen), torch.randn(rows, HEADS, 1, DIM, generator=gen)
            out_k, out_v = layer.update(k, v)
            ref_k, ref_v = torch.cat([ref_k, k], 2), torch.cat([ref_v, v], 2)
            assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
        elif op == "join" and rows < 12:
            other, k, v = filled(rng.randint(1, 3), rng.randint(1, length + 8), gen)
            width = max(length, k.shape[2])
            layer.append_rows(other, max_rows=12)
            ref_k = torch.cat([F.pad(ref_k, (0, 0, width - length, 0)), F.pad(k, (0, 0, width - k.shape[2], 0))])
            ref_v = torch.cat([F.pad(ref_v, (0, 0, width - length, 0)), F.pad(v, (0, 0, width - v.shape[2], 0))])
        elif op == "drop" and rows > 1:
            drop = set(rng.sample(range(rows), rng.randint(1, rows - 1)))
            remaining = rows - len(drop)
            holes = [r for r in sorted(drop) if r < remaining]
            movers = [r for r in range(remaining, rows) if r not in drop]
            order = list(range(remaining))
            for h, m in zip(holes, movers, strict=True):
                order[h] = m
            layer.remove_rows(
                torch.tensor(holes, dtype=torch.long), torch.tensor(movers, dtype=torch.long), remaining, 0
            )
            ref_k, ref_v = ref_k[order], ref_v[order]
        elif op == "trim" and length > 2:
            cut = rng.randint(1, length - 1)
            layer.remove_rows(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), rows, cut)
            ref_k, ref_v = ref_k[:, :, cut:], ref_v[:, :, cut:]
        assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v), op
        assert layer.get_seq_length() == ref_k.shape[2]


def test_decode_steps_write_in_place_until_the_spare_columns_run_out() -> None:
    gen = torch.Generator().manual_seed(1)
    layer, _, _ = filled(3, 4, gen)
    buffer = layer.keys.untyped_storage().data_ptr()
    for _ in range(KV_SPARE_COLUMNS):
        layer.update(torch.zeros(3, HEADS, 1, DIM), torch.zeros(3, HEADS, 1, DIM))
        assert layer.keys.untyped_storage().data_ptr() == buffer
    layer.update(torch.zeros(3, HEADS, 1, DIM), torch.zeros(3, HEADS, 1, DIM))
    assert layer.keys.untyped_storage().data_ptr() != buffer  # grown once, then in place again
    layer.truncate(10)
    assert layer.get_seq_length() == 10

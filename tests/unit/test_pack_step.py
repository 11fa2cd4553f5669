"""pack_step: the packed step tensors of a hand-worked example, logits rows, and refused inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedgen.executor.inputs import SequenceChunk, pack_step

# A mixed step [A0 A1 A2 B0 C0 C1] at block_size 4:
#   A: past 5, three new tokens at positions 5, 6, 7 -> logical block 1 = physical 2 -> slots 9, 10, 11
#   B: past 0, one token at position 0             -> logical block 0 = physical 5 -> slot 20
#   C: past 3, two tokens at positions 3, 4        -> physical 1 offset 3 = slot 7, physical 4 offset 0 = 16
A = SequenceChunk(tokens=[10, 11, 12], past_len=5, block_table=[7, 2])
B = SequenceChunk(tokens=[20], past_len=0, block_table=[5])
C = SequenceChunk(tokens=[30, 31], past_len=3, block_table=[1, 4])


def test_hand_worked_example_packs_exactly():
    inputs = pack_step([A, B, C], block_size=4)
    assert torch.equal(inputs.input_ids, torch.tensor([10, 11, 12, 20, 30, 31], dtype=torch.int64))
    assert torch.equal(inputs.positions, torch.tensor([5, 6, 7, 0, 3, 4], dtype=torch.int64))
    assert torch.equal(inputs.cu_seqlens, torch.tensor([0, 3, 4, 6], dtype=torch.int32))
    assert torch.equal(inputs.past_lens, torch.tensor([5, 0, 3], dtype=torch.int32))
    assert torch.equal(inputs.block_tables, torch.tensor([[7, 2], [5, 0], [1, 4]], dtype=torch.int32))
    assert torch.equal(inputs.slot_mapping, torch.tensor([9, 10, 11, 20, 7, 16], dtype=torch.int64))
    assert torch.equal(inputs.logits_rows, torch.tensor([2, 3, 5], dtype=torch.int64))
    assert (inputs.max_query_len, inputs.max_kv_len, inputs.min_kv_len) == (3, 8, 1)
    assert inputs.block_size == 4
    assert (inputs.num_tokens, inputs.num_seqs) == (6, 3)
    assert torch.equal(inputs.query_lens, torch.tensor([3, 1, 2], dtype=torch.int32))
    assert torch.equal(inputs.kv_lens, torch.tensor([8, 1, 5], dtype=torch.int32))


def test_block_size_one_maps_every_position_to_its_own_block():
    chunk = SequenceChunk(tokens=[1, 2, 3], past_len=2, block_table=[9, 3, 6, 0, 8])
    inputs = pack_step([chunk], block_size=1)
    assert torch.equal(inputs.slot_mapping, torch.tensor([6, 0, 8]))
    assert torch.equal(inputs.positions, torch.tensor([2, 3, 4]))


def test_all_logits_returns_every_row_of_that_request_only():
    c_all = SequenceChunk(tokens=C.tokens, past_len=C.past_len, block_table=C.block_table, all_logits=True)
    assert pack_step([A, B, c_all], block_size=4).logits_rows.tolist() == [2, 3, 4, 5]
    a_all = SequenceChunk(tokens=A.tokens, past_len=A.past_len, block_table=A.block_table, all_logits=True)
    inputs = pack_step([a_all, B, C], block_size=4)
    assert inputs.logits_rows.tolist() == [0, 1, 2, 3, 5]
    assert inputs.logits_rows.dtype == torch.int64


def test_a_longer_block_table_than_needed_is_accepted_and_padded():
    long_b = SequenceChunk(tokens=[20], past_len=0, block_table=[5, 6, 3])
    inputs = pack_step([A, long_b], block_size=4)
    assert inputs.block_tables.tolist() == [[7, 2, 0], [5, 6, 3]]
    assert inputs.slot_mapping.tolist() == [9, 10, 11, 20]


@pytest.mark.parametrize(
    ("chunks", "block_size", "message"),
    [
        ([], 4, "at least one sequence chunk"),
        ([A, SequenceChunk(tokens=[], past_len=0, block_table=[1])], 4, "at least one token"),
        ([SequenceChunk(tokens=[1, 2], past_len=7, block_table=[3, 4])], 4, "holds 2 blocks but needs 3"),
        ([B, SequenceChunk(tokens=[1], past_len=4, block_table=[3])], 4, "request row 1 holds 1 blocks"),
        ([SequenceChunk(tokens=[1], past_len=-1, block_table=[3])], 4, "negative past_len -1"),
        (
            [B, SequenceChunk(tokens=[1], past_len=0, block_table=[-2])],
            4,
            "request row 1 has a negative block",
        ),
        ([A], 0, "block_size must be positive"),
    ],
)
def test_refused_inputs_name_the_problem(chunks, block_size, message):
    with pytest.raises(ValueError, match=message):
        pack_step(chunks, block_size)


# -- no host synchronisation: the step is built on the host and crosses to the device once ---------------


def _count_transfers(monkeypatch) -> list[int]:
    from pagedgen.executor import inputs as inputs_module

    calls: list[int] = []
    real = inputs_module._to_device

    def counting(staging: torch.Tensor, device: torch.device) -> torch.Tensor:
        assert staging.device.type == "cpu"  # what crosses is a host buffer, built before the transfer
        calls.append(staging.numel())
        return real(staging, device)

    monkeypatch.setattr(inputs_module, "_to_device", counting)
    return calls


def test_a_step_for_another_device_is_one_transfer_of_host_built_data(monkeypatch):
    """The meta device holds no data: any read of a packed tensor back to the host (``.item()``,
    ``.tolist()``, ``int(t)``) would raise, so packing for it proves the packing reads nothing back."""
    calls = _count_transfers(monkeypatch)
    chunks = [SequenceChunk([1, 2, 3], 5, [4, 7]), SequenceChunk([9], 0, [2], all_logits=True)]
    inputs = pack_step(chunks, 4, device="meta")
    assert len(calls) == 1
    tensors = [inputs.input_ids, inputs.positions, inputs.cu_seqlens, inputs.past_lens]
    tensors += [inputs.block_tables, inputs.slot_mapping, inputs.logits_rows]
    assert all(t.device.type == "meta" for t in tensors)
    host = inputs.host
    assert host is not None and all(t.device.type == "cpu" for t in (host.input_ids, host.block_tables))
    expected = pack_step(chunks, 4)  # the CPU packing: same values, same dtypes and shapes
    for name in ("input_ids", "positions", "cu_seqlens", "past_lens", "block_tables", "slot_mapping"):
        mine, theirs = getattr(host, name), getattr(expected, name)
        assert mine.dtype == theirs.dtype == getattr(inputs, name).dtype
        assert mine.tolist() == theirs.tolist() and tuple(getattr(inputs, name).shape) == tuple(mine.shape)
    assert (inputs.max_query_len, inputs.max_kv_len, inputs.min_kv_len) == (3, 8, 1)


def test_window_rings_travel_in_the_same_transfer(monkeypatch):
    calls = _count_transfers(monkeypatch)
    inputs = pack_step([SequenceChunk([1], 4, [1, 2], window_ring=[5, 6, 7])], 4, device="meta", window=4)
    assert len(calls) == 1
    ring = inputs.window
    assert all(t.device.type == "meta" for t in (ring.block_tables, ring.first_pos, ring.slot_mapping))


def test_on_the_cpu_there_is_no_transfer_and_the_host_copies_are_the_tensors(monkeypatch):
    calls = _count_transfers(monkeypatch)
    inputs = pack_step([SequenceChunk([1, 2], 0, [3])], 4)
    assert calls == []
    assert inputs.host.input_ids is inputs.input_ids and inputs.host.block_tables is inputs.block_tables


def test_window_rings_keep_host_copies_of_their_first_positions_and_slots():
    inputs = pack_step([SequenceChunk([1], 4, [1, 2], window_ring=[5, 6, 7])], 4, device="meta", window=4)
    expected = pack_step([SequenceChunk([1], 4, [1, 2], window_ring=[5, 6, 7])], 4, window=4).window
    assert inputs.host.window_first_pos.tolist() == expected.first_pos.tolist()
    assert inputs.host.window_slot_mapping.tolist() == expected.slot_mapping.tolist()


def test_a_chunk_that_samples_nothing_gets_no_logits_row():
    """Partial prefills ask for no logits: the step's rows are chosen on the host, before the transfer."""
    chunks = [
        SequenceChunk([1, 2, 3], 0, [0], samples=False),
        SequenceChunk([4], 2, [1]),
        SequenceChunk([5, 6], 1, [2], all_logits=True),
    ]
    assert pack_step(chunks, 4).logits_rows.tolist() == [3, 4, 5]
    assert pack_step(chunks[:2], 4).logits_rows.tolist() == [3]
    assert pack_step(chunks[:1], 4).logits_rows.tolist() == []
    with pytest.raises(ValueError, match="samples none"):
        pack_step([SequenceChunk([1, 2], 0, [0], all_logits=True, samples=False)], 4)


def _same_inputs(mine, theirs) -> None:
    """Every tensor (values, dtype, shape), host copy and scalar of two packed steps agree."""
    for name in ("input_ids", "positions", "cu_seqlens", "past_lens", "block_tables", "slot_mapping"):
        for a, b in ((getattr(mine, name), getattr(theirs, name)), (getattr(mine.host, name), None)):
            b = getattr(theirs.host, name) if b is None else b
            assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and a.tolist() == b.tolist(), name
    assert mine.logits_rows.tolist() == theirs.logits_rows.tolist()
    assert mine.logits_rows.dtype == theirs.logits_rows.dtype
    scalars = (
        "max_query_len",
        "max_kv_len",
        "min_kv_len",
        "block_size",
        "verify_rows",
        "window",
        "num_tokens",
    )
    assert [getattr(mine, s) for s in scalars] == [getattr(theirs, s) for s in scalars]


def test_a_step_of_decodes_packs_exactly_as_the_general_path():
    """Plain decodes (one token, one logits row each) take the short path; it must build the general
    path's step, ragged block tables (zero-padded) included."""
    from pagedgen.executor.inputs import _pack_decodes, _pack_general

    rng = np.random.default_rng(0)
    for rows in (1, 2, 5, 16):
        for block_size in (1, 4, 16):
            chunks = []
            for _ in range(rows):
                past = int(rng.integers(0, 60))
                need = past // block_size + 1
                table = [int(b) for b in rng.integers(0, 500, need + int(rng.integers(0, 3)))]
                chunks.append(SequenceChunk([int(rng.integers(0, 1000))], past, table))
            fast = _pack_decodes(chunks, block_size, torch.device("cpu"))
            assert fast is not None
            _same_inputs(fast, _pack_general(chunks, block_size, "cpu", None))
            _same_inputs(pack_step(chunks, block_size), fast)


@pytest.mark.parametrize(
    "chunk",
    [
        SequenceChunk([1, 2], 0, [3]),  # a prefill
        SequenceChunk([1], 2, [3], all_logits=True),  # a verification row
        SequenceChunk([1], 2, [3], samples=False),
        SequenceChunk([1], -1, [3]),  # refused by the general path
        SequenceChunk([1], 4, [3]),  # table too short
        SequenceChunk([1], 0, [3, -1]),  # a negative block id
        SequenceChunk([], 0, [3]),
    ],
)
def test_anything_but_a_plain_decode_is_left_to_the_general_path(chunk):
    from pagedgen.executor.inputs import _pack_decodes

    assert _pack_decodes([SequenceChunk([7], 0, [1]), chunk], 4, torch.device("cpu")) is None


def test_a_decode_step_for_another_device_is_still_one_transfer(monkeypatch):
    calls = _count_transfers(monkeypatch)
    chunks = [SequenceChunk([4], 6, [1, 2]), SequenceChunk([5], 0, [3])]
    inputs = pack_step(chunks, 4, device="meta")
    assert len(calls) == 1 and inputs.input_ids.device.type == "meta"
    assert (
        inputs.host.slot_mapping.tolist() == pack_step(chunks, 4).slot_mapping.tolist() == [10, 12]
    )  # 2 * 4 + 6 % 4, 3 * 4 + 0

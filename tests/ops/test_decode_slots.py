import pytest
import torch

from llmplug.ops._triton import cpu_kernels
from llmplug.ops.decode_slots import decode_slots, decode_slots_ref


@pytest.mark.parametrize("rows", [1, 19, 99])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("query_len", [1, 5])
def test_kernel_matches_reference(rows, block_size, query_len):
    width = 7
    tables = torch.randint(0, 1000, (rows, width), dtype=torch.int32)
    positions = torch.randint(0, width * block_size - query_len + 1, (rows,))
    positions[torch.rand(rows) < 0.3] = -1  # padding rows
    with cpu_kernels(True):
        got = decode_slots(positions, tables, block_size, query_len)
    for g, w in zip(got, decode_slots_ref(positions, tables, block_size, query_len)):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_reference_semantics():
    tables = torch.tensor([[4, 9], [7, 2]], dtype=torch.int32)
    clamped, slots, lens = decode_slots_ref(torch.tensor([17, -1]), tables, 16)
    assert clamped.tolist() == [17, 0] and slots.tolist() == [9 * 16 + 1, -1] and lens.tolist() == [18, 0]
    # three tokens a row: row 0 crosses into its second page, row 1 is padding
    clamped, slots, lens = decode_slots_ref(torch.tensor([14, -1]), tables, 16, 3)
    assert clamped.tolist() == [14, 15, 16, 0, 1, 2]
    assert slots.tolist() == [4 * 16 + 14, 4 * 16 + 15, 9 * 16, -1, -1, -1] and lens.tolist() == [17, 0]


def test_bad_inputs_and_opcheck():
    tables = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        decode_slots(torch.zeros(2, dtype=torch.int32), tables, 16)
    with pytest.raises(ValueError, match="block_tables"):
        decode_slots(torch.zeros(3, dtype=torch.long), tables, 16)
    with pytest.raises(ValueError, match="query_len"):
        decode_slots(torch.zeros(2, dtype=torch.long), tables, 16, 0)
    torch.library.opcheck(torch.ops.llmplug.decode_slots.default, (torch.tensor([5, -1]), tables, 16, 1))
    torch.library.opcheck(torch.ops.llmplug.decode_slots.default, (torch.tensor([5, -1]), tables, 16, 4))

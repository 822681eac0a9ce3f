import pytest
import torch

from llmplug.ops._triton import cpu_kernels
from llmplug.ops.decode_slots import decode_slots, decode_slots_ref


@pytest.mark.parametrize("rows", [1, 19, 99])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_kernel_matches_reference(rows, block_size):
    width = 7
    tables = torch.randint(0, 1000, (rows, width), dtype=torch.int32)
    positions = torch.randint(0, width * block_size, (rows,))
    positions[torch.rand(rows) < 0.3] = -1  # padding rows
    with cpu_kernels(True):
        got = decode_slots(positions, tables, block_size)
    for g, w in zip(got, decode_slots_ref(positions, tables, block_size)):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_reference_semantics():
    tables = torch.tensor([[4, 9], [7, 2]], dtype=torch.int32)
    clamped, slots, lens = decode_slots_ref(torch.tensor([17, -1]), tables, 16)
    assert clamped.tolist() == [17, 0] and slots.tolist() == [9 * 16 + 1, -1] and lens.tolist() == [18, 0]


def test_bad_inputs_and_opcheck():
    tables = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        decode_slots(torch.zeros(2, dtype=torch.int32), tables, 16)
    with pytest.raises(ValueError, match="block_tables"):
        decode_slots(torch.zeros(3, dtype=torch.long), tables, 16)
    torch.library.opcheck(torch.ops.llmplug.decode_slots.default, (torch.tensor([5, -1]), tables, 16))

import pytest
import torch

from llmplug.ops._triton import cpu_kernels
from llmplug.ops.greedy_step import greedy_step


def _state(rows: int, ring: int = 5, eos=(7, 11), pad: int = 0):
    eos_buf = torch.full((4,), -1, dtype=torch.long)
    eos_buf[:len(eos)] = torch.tensor(eos)
    return {
        "unfinished": torch.rand(rows) < 0.7,
        "eos": eos_buf,
        "pad": torch.tensor([pad]),
        "ring": torch.randint(0, 100, (rows, ring)),
        "input_ids": torch.randint(0, 100, (rows,)),
        "positions": torch.where(torch.rand(rows) < 0.2, -1, torch.randint(0, 50, (rows,))),
        "limits": torch.where(torch.rand(rows) < 0.3, torch.randint(0, 50, (rows,)), 1 << 62),
        "counters": torch.tensor([7, 3]),
    }


def _run(logits, state, kernel: bool):
    out = {k: v.clone() for k, v in state.items()}
    with cpu_kernels(kernel):
        greedy_step(logits, out["unfinished"], out["eos"], out["pad"], out["ring"], out["input_ids"],
                    out["positions"], out["limits"], out["counters"])
    return out


@pytest.mark.parametrize("rows", [1, 3, 19])
@pytest.mark.parametrize("vocab", [1, 37, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(rows, vocab, dtype):
    logits = torch.randn(rows, vocab).to(dtype)
    logits[:, vocab // 2] = logits.max() + 1  # the eos / ties cases below need a known maximum
    if vocab > 11:
        logits[0, 11] = logits.max() + 1  # row 0 picks eos id 11
    if rows > 2 and vocab > 40:
        logits[2, [3, 2100 % vocab, 40]] = logits.max() + 2  # a three-way tie: the first index wins
    state = _state(rows)
    want, got = _run(logits, state, False), _run(logits, state, True)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_reference_semantics():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [9.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    state = {"unfinished": torch.tensor([True, True, False, True]), "eos": torch.tensor([3, -1]),
             "pad": torch.tensor([2]), "ring": torch.zeros(4, 3, dtype=torch.long),
             "input_ids": torch.zeros(4, dtype=torch.long), "positions": torch.tensor([4, 9, 6, -1]),
             "limits": torch.tensor([9, 10, 9, 0]), "counters": torch.tensor([4, 2])}
    out = _run(logits, state, False)
    assert out["input_ids"].tolist() == [1, 0, 2, 3]  # first of the tied maxima; a finished row emits pad
    assert out["unfinished"].tolist() == [True, True, False, False]  # row 3 produced eos
    assert out["ring"][:, 4 % 3].tolist() == [1, 0, 2, 3] and out["ring"][:, 0].tolist() == [0] * 4
    assert out["positions"].tolist() == [5, -1, 7, -1]  # row 1 reached its limit; padding rows stay at -1
    assert out["counters"].tolist() == [5, 5]  # a row was unfinished: this step's tokens count


@pytest.mark.parametrize("kernel", [False, True])
def test_all_finished_rows_stop_the_count(kernel):
    logits = torch.randn(2, 50)
    state = _state(2)
    state["unfinished"][:] = False
    out = _run(logits, state, kernel)
    assert out["counters"].tolist() == [8, 3]
    assert out["input_ids"].tolist() == [0, 0]


@pytest.mark.parametrize("kernel", [False, True])
def test_nan_counts_as_largest(kernel):
    logits = torch.tensor([[0.0, float("nan"), 1.0, float("inf")]])
    state = _state(1)
    state["unfinished"][:] = True
    out = _run(logits, state, kernel)
    assert out["input_ids"].tolist() == [1]


def test_bad_inputs():
    state = _state(2)
    with pytest.raises(ValueError, match="power of two"):
        greedy_step(torch.randn(2, 9), state["unfinished"], torch.tensor([1, 2, 3]), state["pad"], state["ring"],
                    state["input_ids"], state["positions"], state["limits"], state["counters"])
    with pytest.raises(ValueError, match="positions"):
        greedy_step(torch.randn(2, 9), state["unfinished"], state["eos"], state["pad"], state["ring"],
                    state["input_ids"], torch.zeros(3, dtype=torch.long), state["limits"], state["counters"])


def test_opcheck():
    state = _state(3)
    torch.library.opcheck(torch.ops.llmplug.greedy_step.default,
                          (torch.randn(3, 40), *[state[k] for k in ("unfinished", "eos", "pad", "ring", "input_ids",
                                                                     "positions", "limits", "counters")]))


@pytest.mark.parametrize("kernel", [False, True])
def test_advance_step_takes_given_tokens(kernel):
    from llmplug.ops.greedy_step import advance_step

    state = _state(3)
    state["unfinished"][:] = torch.tensor([True, True, False])
    tokens = torch.tensor([11, 4, 9])
    out = {k: v.clone() for k, v in state.items()}
    with cpu_kernels(kernel):
        advance_step(tokens, out["unfinished"], out["eos"], out["pad"], out["ring"], out["input_ids"],
                     out["positions"], out["limits"], out["counters"])
    assert out["input_ids"].tolist() == [11, 4, 0]  # the finished row emits pad
    assert out["unfinished"].tolist() == [False, True, False]  # 11 is an eos id
    assert out["ring"][:, 7 % 5].tolist() == [11, 4, 0] and out["counters"].tolist() == [8, 8]

"""The Engine's device page table (llmplug/engine/page_table.py) against the table built from the lists each step."""

import random

import pytest
import torch

from llmplug.engine.page_table import PageList, PageTable
from llmplug.engine.params import SamplingParams
from llmplug.engine.request import Request


@pytest.mark.parametrize("edit, first", [
    (lambda p: p.append(9), 5), (lambda p: p.extend([9, 9]), 5), (lambda p: p.__setitem__(2, 9), 2),
    (lambda p: p.__setitem__(-1, 9), 4), (lambda p: p.__setitem__(slice(1, 3), [9]), 1),
    (lambda p: p.__delitem__(slice(3, None)), 3), (lambda p: p.__delitem__(1), 1), (lambda p: p.__iadd__([9]), 5),
    (lambda p: p.insert(2, 9), 2), (lambda p: p.pop(), 4), (lambda p: p.pop(0), 0), (lambda p: p.clear(), 0),
    (lambda p: p.remove(3), 0), (lambda p: p.reverse(), 0), (lambda p: p.sort(), 0),
    (lambda p: p.__setitem__(slice(None, None, 2), [7, 7, 7]), 0),
])
def test_page_list_remembers_the_first_changed_index(edit, first):
    pages = PageList([0, 1, 2, 3, 4])
    assert pages.changed == 0  # a new list is copied whole
    pages.changed = None
    edit(pages)
    assert pages.changed == first
    pages.changed = 3
    edit(PageList([0, 1, 2, 3, 4]))  # another list's edit leaves this one alone
    assert pages.changed == 3


def test_sequence_blocks_are_page_lists():
    seq = Request("r", [1, 2, 3], SamplingParams()).seqs[0]
    assert isinstance(seq.blocks, PageList) and seq.blocks == []
    seq.blocks = [4, 5]
    assert isinstance(seq.blocks, PageList) and seq.blocks == [4, 5] and seq.blocks.changed == 0
    child = seq.fork(1)
    assert isinstance(child.blocks, PageList) and child.blocks == [4, 5] and child.blocks is not seq.blocks


@pytest.mark.parametrize("capacity", [6, 40])
def test_rows_equal_the_table_built_from_the_lists(capacity):
    """Random steps of random subsets of sequences whose lists grow, shrink, get replaced and edited in place; with a
    small capacity rows are taken back and lists copied whole again; the table widens past its first width."""
    rng = random.Random(capacity)
    table = PageTable(capacity, torch.device("cpu"), width=4)
    lists = [PageList(rng.sample(range(1000), rng.randint(1, 6))) for _ in range(12)]
    for _ in range(300):
        for i in rng.sample(range(len(lists)), 3):
            p, kind = lists[i], rng.randrange(5)
            if kind == 0:
                p.extend(rng.sample(range(1000), rng.randint(1, 5)))
            elif kind == 1 and len(p) > 1:
                del p[rng.randrange(1, len(p)):]
            elif kind == 2:
                p[rng.randrange(len(p))] = rng.randrange(1000)
            elif kind == 3:
                lists[i] = PageList(rng.sample(range(1000), rng.randint(1, 6)))
            else:
                p.append(rng.randrange(1000))
        step = rng.sample(lists, rng.randint(1, 5))
        got = table.rows(step)
        assert got.shape[0] == len(step) and got.shape[1] >= max(map(len, step))
        for row, p in zip(got.tolist(), step):  # past a list's end: page ids it held before, never read
            assert row[:len(p)] == list(p)
    assert table.table.shape[1] > 4


def test_a_step_wider_than_the_capacity_is_refused():
    table = PageTable(2, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs more than the page table's 2 rows"):
        table.rows([PageList([1]), PageList([2]), PageList([3])])


def test_the_same_lists_again_send_only_what_changed():
    """Decode steps of one batch: the last call's lists in its order reuse their rows; with nothing changed the same
    tensor comes back, an edit or a longer list reaches the device."""
    table = PageTable(8, torch.device("cpu"), width=2)
    lists = [PageList([1, 2]), PageList([3]), PageList([4, 5])]
    first = table.rows(lists)
    assert table.rows(lists) is first
    lists[1].append(6)
    lists[0][1] = 7
    got = table.rows(list(lists))  # another list object holding the same lists
    assert got.tolist() == [[1, 7], [3, 6], [4, 5]]
    lists[2].extend([8, 9])  # past the table's first width
    assert table.rows(lists).tolist() == [[1, 7, 0, 0], [3, 6, 0, 0], [4, 5, 8, 9]]
    assert table.rows(lists[:2]).tolist() == [[1, 7], [3, 6]]  # other lists: the full path again

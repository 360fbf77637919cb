"""The validation set split off when no validation file is given: seeded, stated, never empty."""

from __future__ import annotations

import pytest

from aiayn.data.parallel import DataError
from aiayn.finetune.split import split_examples


def test_the_split_is_seeded_disjoint_and_covers_every_example():
    split = split_examples(240, seed=0)
    assert split == split_examples(240, seed=0)
    assert split.val != split_examples(240, seed=1).val
    assert len(split.val) == 12 and sorted(split.train + split.val) == list(range(240))
    assert split.statement == "validation: 5% of the examples (12), seed 0; give --val-data to choose"


def test_a_small_set_keeps_one_example_on_each_side():
    assert len(split_examples(3, seed=0).val) == 1
    two = split_examples(2, seed=7, fraction=0.9)
    assert len(two.val) == 1 and len(two.train) == 1
    assert two.statement == "validation: 90% of the examples (1), seed 7; give --val-data to choose"


def test_a_set_too_small_to_split_is_refused_in_one_line():
    with pytest.raises(DataError, match=r"^too few conversations to split off a validation set \(1; it takes at "
                                        r"least 2\); add conversations, or give --val-data$"):
        split_examples(1, seed=0, what="conversations")
    with pytest.raises(ValueError, match="fraction must lie in"):
        split_examples(10, seed=0, fraction=1.0)

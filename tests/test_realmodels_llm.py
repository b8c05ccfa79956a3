"""benchmarks/realmodels_llm.py (the SmolLM2 benchmark downloads its model at run time; the suite
never does): its windows and perplexity, on made-up tokens."""
import numpy as np
import pytest

from benchmarks import realmodels_llm as llm
from lnfold.passes import LnfoldError


def test_windows_are_the_first_consecutive_tokens():
    ids = list(range(1000))
    w = llm.windows(ids, n=3, seq=256)
    assert w.shape == (3, 256) and w.dtype == np.int64
    assert w[0, 0] == 0 and w[1, 0] == 256 and w[2, -1] == 767  # consecutive, from the first token
    assert (llm.windows(ids, n=3, seq=256) == w).all()
    with pytest.raises(LnfoldError, match="need 1024"):
        llm.windows(ids, n=4, seq=256)


def test_perplexity_of_known_distributions():
    ids = np.array([[0, 1, 2, 3]])
    uniform = np.zeros((1, 4, 10), dtype=np.float32)
    assert llm.perplexity(uniform, ids) == pytest.approx(10.0)
    sure = np.full((1, 4, 10), -30.0, dtype=np.float32)
    sure[0, np.arange(3), ids[0, 1:]] = 30.0  # position t predicts token t+1
    assert llm.perplexity(sure, ids) == pytest.approx(1.0)
    sure_off = np.full((1, 4, 10), -30.0, dtype=np.float32)
    sure_off[0, np.arange(4), ids[0]] = 30.0  # predicts the current token: wrong by one
    assert llm.perplexity(sure_off, ids) > 1e20

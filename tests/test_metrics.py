import pytest
import torch

from marlhf.metrics import repeated_ngram_fraction, row_l2, text_repetition, token_repetition


def reference(tokens, n):
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    repeated = sum(1 for i, g in enumerate(grams) if g in grams[:i])
    return repeated / len(grams) if grams else 0.0


@pytest.mark.parametrize("tokens", [[], [1], [1, 2], [1, 2, 3], [1, 2, 1, 2, 1, 2], [5] * 10,
                                    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4]])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_matches_counting_reference(tokens, n):
    assert repeated_ngram_fraction(tokens, n) == pytest.approx(reference(tokens, n))


def test_repeated_phrase_scores_high_and_fresh_text_zero():
    loop = "the answer is great . " * 20
    scores = text_repetition([loop, "every word here is different from the others"], n=3)
    assert scores[0] > 0.9
    assert scores[1] == 0.0


def test_token_repetition_ignores_padding():
    ids = torch.tensor([[7, 8, 7, 8, 0, 0], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[True, True, True, True, False, False], [True] * 6])
    # row 0 real tokens [7, 8, 7, 8]: bigrams (7,8) (8,7) (7,8) -> 1 of 3 repeated; padding zeros would add more
    assert token_repetition(ids, mask, n=2).tolist() == pytest.approx([1 / 3, 0.0])


def test_rejects_bad_n():
    with pytest.raises(ValueError, match="n must be"):
        repeated_ngram_fraction([1, 2], 0)


def test_row_l2_is_the_mean_row_norm_over_real_tokens():
    x = torch.tensor([[3.0, 4.0, 100.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert row_l2(x, mask).item() == pytest.approx((5.0 + 1.0) / 2)

from __future__ import annotations

import time

import pytest
import torch

from marlhf.data.encoding import pad_sequences
from marlhf.errors import MarlhfError
from marlhf.modeling import (ScalarHeadModel, check_model_path, last_token_index, load_causal_lm, load_tokenizer,
                             position_ids_from_mask, sequence_logprobs, token_logprobs)
from tests.hub_cache import put_in_hub_cache


def test_token_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11) * 3
    tokens = torch.randint(0, 11, (5, 7))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    for chunk in (1, 2, 8):
        torch.testing.assert_close(token_logprobs(logits, tokens, temperature=0.7, chunk_size=chunk), expected)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, temperature=0)


def test_padding_helpers():
    ids, mask = pad_sequences([[1, 2, 3], [4]], pad_token_id=0, padding_side="left")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert position_ids_from_mask(mask).tolist() == [[0, 1, 2], [0, 0, 0]]
    ids, mask = pad_sequences([[1, 2, 3], [4]], pad_token_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and last_token_index(mask).tolist() == [2, 0]
    left_and_right = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    assert last_token_index(left_and_right).tolist() == [2, 3]
    with pytest.raises(ValueError):
        pad_sequences([[1], []], 0)


def test_sequence_logprobs_left_padding_matches_unpadded(make_tiny_causal_lm):
    model = make_tiny_causal_lm().eval()
    prompt, response = [5, 6, 7], [8, 9]
    padded, mask = pad_sequences([prompt + response, [1, 2, 3, 4, 5, 6] + response], 0, "left")
    with torch.no_grad():
        batched = sequence_logprobs(model, padded, mask, num_tokens=2)
        alone = sequence_logprobs(model, torch.tensor([prompt + response]), torch.ones(1, 5, dtype=torch.long),
                                  num_tokens=2)
        full = torch.log_softmax(model(torch.tensor([prompt + response])).logits, -1)
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone[0], full[0, 2:4].gather(-1, torch.tensor([[8], [9]])).squeeze(-1))


def test_scalar_head_values_and_score(tmp_path, make_tiny_causal_lm):
    model = ScalarHeadModel(make_tiny_causal_lm().model)
    ids, mask = pad_sequences([[3, 4, 5], [6, 7]], 0)
    values = model(ids, mask)
    assert values.shape == (2, 3) and values.dtype == torch.float32
    torch.testing.assert_close(model.score(ids, mask), torch.stack([values[0, 2], values[1, 1]]))
    model.save_pretrained(tmp_path)
    reloaded = ScalarHeadModel.from_pretrained(tmp_path)
    torch.testing.assert_close(reloaded(ids, mask), values)


def test_loaders_from_directory(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir), padding_side="left")
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "<pad>"
    model = load_causal_lm(str(tiny_model_dir), gradient_checkpointing=True)
    assert model.is_activation_checkpointing and model.dtype == torch.float32
    critic = ScalarHeadModel.from_pretrained(tiny_model_dir)  # causal-LM checkpoint: head starts fresh
    assert critic.head.weight.shape == (1, model.config.hidden_size)


def test_pad_token_falls_back_to_eos(tmp_path, tiny_tokenizer):
    tiny_tokenizer.save_pretrained(tmp_path)
    import json
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.pad_token == "</s>"


@pytest.mark.parametrize("status, expected", [(503, r"answered HTTP 503 Service Unavailable after \d+ tries in"),
                                              (None, r"failed \(timed out\) after 1 try in 2\.\d s")])
def test_a_hub_that_fails_or_hangs_is_given_up_within_the_limit(fake_hub, status, expected):
    fake_hub.status = status
    started = time.monotonic()
    with pytest.raises(MarlhfError, match=rf"'no/model' is neither .* the Hub \(http://127.0.0.1:\d+\) is "
                                          rf"unreachable: it {expected}.*raise MARLHF_HUB_TIMEOUT \(now 2 s\)"):
        check_model_path("no/model")
    assert time.monotonic() - started < 10  # behaviour, not a benchmark: the download's retries take minutes


def test_a_hub_id_the_hub_does_not_have_is_one_line_at_once(fake_hub):
    fake_hub.status = 404
    with pytest.raises(MarlhfError, match="answered HTTP 404 Not Found for it: check the id"):
        check_model_path("no/model")
    assert fake_hub.requests == ["/no/model/resolve/main/config.json"]  # not retried
    fake_hub.status = 200
    check_model_path("no/model")  # there: from_pretrained downloads it


def test_a_cached_hub_id_is_loaded_offline_when_the_hub_hangs(fake_hub, tmp_path):
    import huggingface_hub.constants as hub

    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "config.json").write_text("{}")
    put_in_hub_cache(tmp_path / "hub", "cached/model", tmp_path / "files")
    fake_hub.status = None
    check_model_path("cached/model")
    assert hub.HF_HUB_OFFLINE  # from_pretrained reads the cache without asking the Hub once per file
    check_model_path("cached/model")
    assert len(fake_hub.requests) == 1


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_the_hub_timeout_must_be_positive_seconds(fake_hub, monkeypatch, value):
    monkeypatch.setenv("MARLHF_HUB_TIMEOUT", value)
    with pytest.raises(MarlhfError, match=f"MARLHF_HUB_TIMEOUT='{value}' must be a number of seconds > 0"):
        check_model_path("no/model")

"""The incremental detokenizer calls the `tokenizers` backend directly where transformers' decode is exactly that
backend's decode: the same text as `tokenizer.decode` for every id, special tokens kept or skipped, and the same
incremental output (UTF-8 held back, stop strings) as through transformers."""

import random

import pytest

from vserve.core.detokenizer import IncrementalDetokenizer, backend_decoder
from vserve.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("skip", [True, False])
def test_backend_decode_equals_transformers_decode(tokenizer, skip):
    backend = backend_decoder(tokenizer)
    assert backend is not None, "the embedded model's tokenizer should take the direct path"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    special = sorted(tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randint(0, 12))]
        assert backend.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip), \
            (seed, ids)


def test_incremental_output_is_the_same_through_either_path(tokenizer, monkeypatch):
    """Token by token over multi-byte text (emoji, CJK) and a stop string: identical text and stop."""
    text = "Hello 世界! 🙂🙃 naïve café — the end. STOP here"
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["STOP"], skip_special_tokens=True)

    def run(direct: bool):
        d = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
        if not direct:
            d._backend = None
        stops, pieces = [], []
        for t in ids:
            stops.append(d.update(t, check_stop=True))
            pieces.append(d.new_text(finished=stops[-1] is not None))
            if stops[-1] is not None:  # the front end finishes the request here
                break
        return d.output_text, stops, pieces

    direct, plain = run(True), run(False)
    assert direct == plain and direct[0] == text[:text.index("STOP")] and direct[1][-1] == "STOP"
    assert "".join(direct[2]) == direct[0]


def test_tokenizers_that_clean_up_spaces_keep_transformers_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert backend_decoder(tokenizer) is None
    assert backend_decoder(None) is None

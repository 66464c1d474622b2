"""Document boundaries (data.reset_position_ids / reset_attention_mask / eod_mask_loss): every
architecture computes each document of a packed sequence exactly as it computes the document
alone, with the masks and positions megatron-core's GPTDataset makes; the config checks."""

import warnings

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.models.build import build
from rmt.models.documents import Documents, causal_mask, document_starts

from conftest import tiny_overrides, train_cases

warnings.filterwarnings("ignore")

EOD = 9
UNIT = ["model.vocab_size=10", "model.seq_length=24", "model.num_layers=2", "train.seed=3"]
ULTRAMEM = [
    "memory.type=ultramem",
    "memory.placement='1:2'",
    "memory.key_dim=8",
    "memory.num_keys=4",
    "memory.topk=3",
    "memory.init_samples=2",
    "memory.conv_kernel=3",
]
ARCHS = {
    "transformer-learned+ultramem": ["model.hidden_size=16", "model.num_attention_heads=2"] + ULTRAMEM,
    "transformer-rope": ["model.hidden_size=16", "model.num_attention_heads=2", "model.position=rope"],
    "rmt-alibi+ultramem": ["model.arch=rmt", "model.dk=4", "model.dv=4", "model.rank=2", "model.ffn_hidden_size=16"]
    + ULTRAMEM,
    "rmt-learned": [
        "model.arch=rmt",
        "model.dk=4",
        "model.dv=4",
        "model.rank=2",
        "model.ffn_hidden_size=16",
        "model.position=learned",
    ],
    "recurrent": [
        "model.arch=recurrent",
        "model.hidden_size=16",
        "model.num_attention_heads=2",
        "model.block_width=4",
        "model.recurrent_alpha=0.7",
    ],
    "mixer": ["model.arch=mixer", "model.hidden_size=16", "model.num_attention_heads=2", "model.mixer_decay=true"],
}
# Two rows of packed documents (lengths include the EOD that ends each), cut anywhere.
LENGTHS = [[5, 11, 8], [3, 7, 1, 13]]


def packed_batch():
    gen = torch.Generator().manual_seed(0)
    rows, docs = [], []
    for lengths in LENGTHS:
        row = []
        for n in lengths:
            doc = torch.randint(0, EOD, (n,), generator=gen)
            doc[-1] = EOD
            docs.append((len(rows), sum(len(d) for d in row), doc))
            row.append(doc)
        rows.append(torch.cat(row)[:24])
    tokens = torch.stack(rows)
    masks = [_get_ltor_masks_and_position_ids(r, EOD, True, True, False, True) for r in tokens]
    mask = torch.stack([m[0] for m in masks])  # [b, 1, s, s], True = masked
    positions = torch.stack([m[2] for m in masks])
    return tokens, positions, mask, [(b, start, doc[: 24 - start]) for b, start, doc in docs if start < 24]


@pytest.fixture(params=sorted(ARCHS))
def model(request):
    config = validate(load_config(None, UNIT + ARCHS[request.param]), world_size=1)
    parallel.initialize(config)
    torch.manual_seed(0)
    chunk = build(config)[0].eval()
    with torch.no_grad():  # every parameter away from its constant init (norm gains, biases)
        for p in chunk.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype) * 0.05)
    yield chunk
    parallel.destroy()


@torch.no_grad()
def test_packed_documents_equal_per_document_runs(model):
    tokens, positions, mask, docs = packed_batch()
    packed = model(tokens, positions, mask)
    causal = model(tokens, positions, causal_mask(24, tokens.device))
    crossed = 0.0
    for b, start, doc in docs:
        n = doc.numel()
        alone = model(doc[None], torch.arange(n)[None], causal_mask(n, doc.device))[0]
        torch.testing.assert_close(packed[b, start : start + n], alone, atol=2e-5, rtol=0)
        crossed = max(crossed, float((causal[b, start : start + n] - alone).abs().max()))
    assert crossed > 1e-2  # without the document mask the later documents see the earlier ones


def test_document_starts_and_unpack_roundtrip():
    tokens, _, mask, _ = packed_batch()
    starts = document_starts(mask)
    assert starts[0].tolist() == [0] * 5 + [5] * 11 + [16] * 8
    assert starts[1].tolist() == [0] * 3 + [3] * 7 + [10] + [11] * 13
    assert document_starts(causal_mask(24, tokens.device)) is None
    assert document_starts(torch.ones(24, 24, dtype=torch.bool).triu(1)[None, None]) is None  # read: no boundary
    docs = Documents(starts)
    assert (docs.num, docs.length) == (7, 13)
    rows = docs.unpack(tokens, fill=-1)
    assert rows[6].tolist() == tokens[1, 11:].tolist() and rows[5].tolist() == [EOD] + [-1] * 12
    assert torch.equal(docs.pack(rows), tokens)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["data.reset_position_ids=true", "model.position=rope"],
            "data.reset_position_ids has no effect here (model.position 'rope' depends on token distances only); set "
            "data.reset_attention_mask to compute every document as if alone",
        ),
        (
            ["data.reset_position_ids=true", "model.arch=mixer"],
            "data.reset_position_ids has no effect here (the mixer has no position ids); set data.reset_attention_mask "
            "to compute every document as if alone",
        ),
        (
            ["data.eod_mask_loss=true", "data.task=copy", "model.seq_length=160"],
            "data.eod_mask_loss needs documents; the synthetic task 'copy' has none",
        ),
    ],
)
def test_document_keys_rejected(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), world_size=1)
    assert str(err.value) == message


def test_dataset_samples_carry_document_masks(cache_dir):
    """The trainer's data path: GPTDataset samples with the keys set carry the block-causal mask,
    restarted positions and the loss mask without the EOD positions."""
    from rmt.data.gpt_data import build_datasets, resolve_data

    config = validate(
        load_config(
            None,
            [
                f"data.cache_dir={cache_dir}",
                "data.max_documents=20",
                "model.seq_length=256",
                "data.reset_position_ids=true",
                "data.reset_attention_mask=true",
                "data.eod_mask_loss=true",
            ],
        ),
        1,
    )
    train, _ = build_datasets(config, resolve_data(config), 64, 0)
    sample = next(s for s in (train[i] for i in range(64)) if (s["tokens"] == 256).any())
    eod = int((sample["tokens"] == 256).nonzero()[0])
    assert sample["attention_mask"].shape == (1, 256, 256)
    assert sample["attention_mask"][0, eod + 1, eod] and not sample["attention_mask"][0, eod, 0]
    assert sample["position_ids"][eod + 1] == 0 and sample["loss_mask"][eod] == 0
    assert sample["loss_mask"].sum() == 256 - int((sample["tokens"] == 256).sum())


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """An indexed dataset of 300 documents of 2..30 bytes: every 32-token sample crosses one."""
    from rmt.data.shards import write_indexed
    from rmt.data.tokenizers import ByteTokenizer

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 31, (300,), generator=gen).tolist()
    docs = [torch.randint(32, 127, (n,), generator=gen).tolist() for n in lengths]
    prefix = str(tmp_path_factory.mktemp("short_docs") / "docs")
    write_indexed(prefix, docs, ByteTokenizer())
    return prefix


DOCUMENT_KEYS = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]
LAYOUT_CASES = {
    "transformer+ultramem-tp2": (
        ARCHS["transformer-learned+ultramem"][2:] + ["model.hidden_size=32", "model.num_attention_heads=4"],
        ["parallel.tensor_model_parallel_size=2"],
    ),
    "rmt+ultramem-pp2": (
        ["model.arch=rmt", "model.dk=4", "model.dv=8", "model.rank=4", "model.ffn_hidden_size=32", "model.num_layers=4"]
        + ULTRAMEM[:1]
        + ["memory.placement='3:4'"]
        + ULTRAMEM[2:],
        ["parallel.pipeline_model_parallel_size=2"],
    ),
    "recurrent-dp2": (ARCHS["recurrent"], []),
}


@pytest.fixture(scope="module")
def layout_runs(short_documents, cache_dir, tmp_path_factory):
    """Every case's single-process run in this process, its layout in one launch of 2 processes."""
    cases = {}
    for case, (arch, layout) in LAYOUT_CASES.items():
        base = tiny_overrides(cache_dir) + arch + DOCUMENT_KEYS + [f"data.path={short_documents}"]
        cases.update({f"{case}-single": (base, 1), case: (base + layout, 2)})
    return train_cases(tmp_path_factory, "document_layouts", cases)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_document_keys_under_parallel_layouts(case, layout_runs):
    """3 training steps with the document keys on data of short documents: TP=2 (masked
    attention and the memory convolution), PP=2 (the mask and document starts reach the second
    stage and its memory layer), DP=2 (documents run as their own sequences) == one process."""
    ref, got = layout_runs[f"{case}-single"], layout_runs[case]
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    for key in ref["grads"]:
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)

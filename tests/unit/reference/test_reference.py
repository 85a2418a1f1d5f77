"""Reference statistics: online == precomputed b, the store on disk, fingerprints, sharding, c_base.

Two test-local reference modules stand in for ``ZCVAE(mode="reference")``: a tiny Hugging Face Llama
and a smaller prefix-mean LM (cheap enough for the two-process gloo test). Both compute the per-token
NLL with ``losses.token_nll`` + ``gather_span``, as the model does; they are scaffolding, not the code
under test.
"""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zcvae.config import TrainConfig
from zcvae.core.losses import base_loss, gather_span, surprisal_share_weights, token_nll
from zcvae.reference.c_base import CBase, c_base_from_store, c_base_from_sum_count, c_base_sum_count, resolve_c_base
from zcvae.reference.provider import ReferenceProvider
from zcvae.reference.store import (
    ReferenceFingerprint,
    ReferenceStore,
    ReferenceStoreError,
    compute_reference_store,
    default_policy,
    fingerprint_backbone,
    iter_reference_batches,
    load_or_build_reference_store,
    num_reference_forwards,
    reference_fingerprint,
    sidecar_path,
    store_path,
)
from zcvae.data.encoding import EncodedExample, TemplateTokens, collate

TOKENS = TemplateTokens(bos=1, eos=2, pad=0, x_open=3, x_close=4, z_open=5, z_close=6, y_open=7, y_close=8, znull=9)
VOCAB = 24
LLAMA_SIZES = dict(hidden_size=16, intermediate_size=32, max_position_embeddings=64)  # the conftest's tiny Llama, smaller


def make_examples(num: int, *, seed: int = 0, prefix: str = "ex") -> list[EncodedExample]:
    rng = random.Random(seed)
    return [
        EncodedExample(
            f"{prefix}{i}",
            tuple(rng.randrange(10, VOCAB) for _ in range(rng.randrange(0, 6))),
            tuple(rng.randrange(10, VOCAB) for _ in range(rng.randrange(1, 8))),
        )
        for i in range(num)
    ]


class PrefixMeanLM(nn.Module):
    """A causal LM small enough to build in a spawned process: logits from the prefix mean embedding."""

    def __init__(self, vocab: int = VOCAB, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)
        self.calls = 0

    def forward(self, batch, mode: str = "reference"):
        assert mode == "reference"
        self.calls += 1
        h_BTD = self.emb(batch.input_ids).cumsum(1)
        h_BTD = h_BTD / torch.arange(1, h_BTD.shape[1] + 1)[None, :, None]  # right padding: real rows unaffected
        nll_BT = token_nll(self.out(torch.tanh(h_BTD)), batch.labels)
        return gather_span(nll_BT, batch.labels)


class LlamaReference(nn.Module):
    """``module(batch, mode="reference") -> (ref_nll_BN, mask_BN)`` over a Hugging Face causal LM."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.calls = 0

    def forward(self, batch, mode: str = "reference"):
        assert mode == "reference"
        self.calls += 1
        with torch.no_grad():
            logits_BTV = self.lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            return gather_span(token_nll(logits_BTV, batch.labels), batch.labels)


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return tiny_llama(VOCAB, **LLAMA_SIZES)


def fp(examples, backbone="b" * 64, extra=None) -> ReferenceFingerprint:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return reference_fingerprint(backbone=backbone, tokens=TOKENS, vocab=vocab, examples=examples, extra=extra)


# ------------------------------------------------------------------------------- policies, online == precomputed
def test_default_policy():
    assert default_policy(1) == "online" and default_policy(0.5) == "online"
    assert default_policy(1.01) == "precomputed" and default_policy(3) == "precomputed"
    for bad in (0, -1, float("nan"), True):
        with pytest.raises(ValueError, match="num_passes"):
            default_policy(bad)


def test_online_and_precomputed_give_the_same_b_and_losses(llama):
    module = LlamaReference(llama)
    examples = make_examples(9, seed=1)
    # precomputed: sorted, batches of 2 (a different composition than training's batches of 3)
    values = compute_reference_store(module, iter_reference_batches(examples, TOKENS, batch_size=2, rank=0, world_size=1), rank=0, world_size=1)
    store = ReferenceStore.from_values(values, fingerprint=fp(examples).digest)
    assert set(store.ids) == {ex.id for ex in examples}
    for start in range(0, 9, 3):
        batch = collate(examples[start : start + 3], TOKENS)
        online_ref, online_mask = module(batch)  # what the trainer's online policy reads
        pre_ref, pre_mask = store.lookup(batch.ids, device="cpu")
        assert pre_ref.shape == online_ref.shape and torch.equal(pre_mask, online_mask)
        torch.testing.assert_close(pre_ref, online_ref, rtol=0, atol=1e-5)
        assert float(online_ref[online_mask].std()) > 0.05  # b is not trivially constant
        for mode in ("mean", "sum"):
            torch.testing.assert_close(base_loss(pre_ref, pre_mask, mode), base_loss(online_ref, online_mask, mode), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(surprisal_share_weights(pre_ref, pre_mask, 1.0)[0], surprisal_share_weights(online_ref, online_mask, 1.0)[0])
    # with the training batches themselves the two policies are bitwise identical
    same = compute_reference_store(module, [collate(examples[s : s + 3], TOKENS) for s in range(0, 9, 3)], rank=0, world_size=1)
    for start in range(0, 9, 3):
        batch = collate(examples[start : start + 3], TOKENS)
        assert torch.equal(ReferenceStore.from_values(same, fingerprint="x").lookup(batch.ids)[0], module(batch)[0])


# ------------------------------------------------------------------------------- the store on disk
def test_store_round_trips_through_disk_and_lookup_pads_left_aligned(tmp_path):
    examples = make_examples(5)
    values = compute_reference_store(PrefixMeanLM(), [collate(examples, TOKENS)], rank=0, world_size=1)
    f = fp(examples)
    store = ReferenceStore.from_values(values, fingerprint=f.digest)
    path = store_path(tmp_path / "cache", "train", f.digest)
    store.save(path, parts=f.to_dict())
    assert sorted(os.listdir(path.parent)) == sorted([path.name, sidecar_path(path).name])  # no temp file left
    loaded = ReferenceStore.load(path, fingerprint=f.digest)
    assert loaded.ids == store.ids and loaded.fingerprint == f.digest
    assert torch.equal(loaded.values, store.values) and torch.equal(loaded.offsets, store.offsets)
    side = json.loads(sidecar_path(path).read_text())
    assert side["fingerprint"] == f.digest and side["parts"] == f.to_dict() and side["num_examples"] == 5

    ids = ["ex3", "ex0"]
    ref_BN, mask_BN = loaded.lookup(ids, n_span=9)
    for i, ex_id in enumerate(ids):
        n = len(values[ex_id])
        assert torch.equal(ref_BN[i, :n], values[ex_id]) and mask_BN[i, :n].all()
        assert not mask_BN[i, n:].any() and (ref_BN[i, n:] == 0).all()
    with pytest.raises(KeyError, match="nope"):
        loaded.lookup(["ex1", "nope"])
    with pytest.raises(ReferenceStoreError, match="fingerprint"):
        ReferenceStore.load(path, fingerprint=fp(examples, backbone="c" * 64).digest)


def test_corrupt_store_is_named_and_rebuilt(tmp_path):
    examples = make_examples(6)
    f = fp(examples)
    module = PrefixMeanLM()
    store = load_or_build_reference_store(module, examples, TOKENS, fingerprint=f, name="val", batch_size=4, cache_dir=tmp_path)
    path = store_path(tmp_path, "val", f.digest)
    data = path.read_bytes()

    path.write_bytes(data[: len(data) - 7])  # truncated
    with pytest.raises(ReferenceStoreError, match=str(path)):
        ReferenceStore.load(path)
    header_len = int.from_bytes(data[:8], "little")
    start, _ = json.loads(data[8 : 8 + header_len])["values"]["data_offsets"]
    flipped = bytearray(data)
    flipped[8 + header_len + start + 1] ^= 0x01  # inside the values: the header still parses
    path.write_bytes(bytes(flipped))
    with pytest.raises(ReferenceStoreError, match="checksum"):
        ReferenceStore.load(path)

    calls = module.calls
    with pytest.warns(UserWarning, match=path.name):
        rebuilt = load_or_build_reference_store(module, examples, TOKENS, fingerprint=f, name="val", batch_size=4, cache_dir=tmp_path)
    assert module.calls > calls
    assert torch.equal(rebuilt.values, store.values)
    assert torch.equal(ReferenceStore.load(path, fingerprint=f.digest).values, store.values)  # rewritten whole


def test_store_is_reused_until_backbone_or_data_change(tmp_path, llama, tiny_llama):
    fb = fingerprint_backbone
    examples = make_examples(6, seed=3)
    llama.save_pretrained(tmp_path / "bb1")
    llama.save_pretrained(tmp_path / "bb2")
    assert fb(tmp_path / "bb1" / "model.safetensors") == fb(tmp_path / "bb2" / "model.safetensors")
    assert fb(tmp_path / "bb1") == fb(tmp_path / "bb2")
    changed = tiny_llama(VOCAB, **LLAMA_SIZES)
    with torch.no_grad():
        changed.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    changed.save_pretrained(tmp_path / "bb3")
    assert fb(tmp_path / "bb3") != fb(tmp_path / "bb1")
    assert fb(changed) != fb(llama) and fb(llama) == fb(tiny_llama(VOCAB, **LLAMA_SIZES))
    with pytest.raises(ValueError, match="safetensors"):
        fb(tmp_path / "cache-does-not-exist")

    def build(backbone_dir, exs, module):
        f = fp(exs, backbone=fb(backbone_dir))
        return f, load_or_build_reference_store(module, exs, TOKENS, fingerprint=f, name="train", batch_size=4, cache_dir=tmp_path / "cache")

    module = LlamaReference(llama)
    f1, s1 = build(tmp_path / "bb1", examples, module)
    first = module.calls
    assert first == 2
    f1b, s1b = build(tmp_path / "bb1", list(reversed(examples)), module)  # reused: order is not data
    assert module.calls == first and f1b.digest == f1.digest and torch.equal(s1b.values, s1.values)

    module3 = LlamaReference(changed)
    f3, s3 = build(tmp_path / "bb3", examples, module3)  # changed backbone: rebuilt, different b
    assert f3.changed(f1) == ["backbone"] and module3.calls == 2
    assert not torch.equal(s3.values, s1.values)

    edited = [examples[0], EncodedExample(examples[1].id, examples[1].x_ids, examples[1].y_ids + (11,)), *examples[2:]]
    f4, s4 = build(tmp_path / "bb1", edited, module)  # changed example: rebuilt
    assert f4.changed(f1) == ["data"] and module.calls == first + 2
    assert s4.get(examples[1].id).numel() == s1.get(examples[1].id).numel() + 1
    assert fp(examples, extra={"precision": "bf16"}).changed(fp(examples)) == ["extra"]
    with pytest.raises(ValueError, match="duplicate example id"):
        fp([examples[0], examples[0]])


# ------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("num, batch_size, world", [(7, 3, 2), (3, 2, 4), (10, 2, 3), (0, 2, 2), (5, 5, 1)])
def test_reference_batches_shard_evenly_and_cover_each_example_once(num, batch_size, world):
    examples = make_examples(num, seed=num)
    shuffled = random.Random(0).sample(examples, len(examples))
    expected = num_reference_forwards(num_examples=num, batch_size=batch_size, world_size=world)
    kept: list[str] = []
    for rank in range(world):
        items = list(iter_reference_batches(examples, TOKENS, batch_size=batch_size, rank=rank, world_size=world))
        again = list(iter_reference_batches(shuffled, TOKENS, batch_size=batch_size, rank=rank, world_size=world))
        assert len(items) == expected  # every rank runs the same number of forwards
        assert [it.batch.ids for it in items] == [it.batch.ids for it in again]  # deterministic
        assert all(len(it.batch) <= batch_size for it in items)
        kept += [i for it in items if it.keep for i in it.batch.ids]
    assert sorted(kept) == sorted(ex.id for ex in examples)
    with pytest.raises(ValueError, match="rank"):
        next(iter_reference_batches(examples, TOKENS, batch_size=2, rank=world, world_size=world))


def test_rebuild_is_decided_by_all_ranks_together(tmp_path):
    """Rank 0 finds the store on its (node-local) disk, rank 1 does not: both must run the forwards."""
    import threading

    examples = make_examples(7, seed=9)
    f = fp(examples)
    barrier, slots = threading.Barrier(2, timeout=30), [None, None]  # a rank-local decision would hang: fail instead

    def gather_for(rank):
        def all_gather_object(out, obj):  # the semantics of torch.distributed.all_gather_object
            slots[rank] = obj
            barrier.wait()
            out[:] = list(slots)
            barrier.wait()
        return all_gather_object

    torch.manual_seed(0)
    modules = [PrefixMeanLM(), PrefixMeanLM()]
    modules[1].load_state_dict(modules[0].state_dict())
    load_or_build_reference_store(modules[0], examples, TOKENS, fingerprint=f, name="t", batch_size=2, cache_dir=tmp_path / "node0")
    calls = [m.calls for m in modules]
    results = [None, None]

    def run(rank):
        results[rank] = load_or_build_reference_store(
            modules[rank], examples, TOKENS, fingerprint=f, name="t", batch_size=2, rank=rank, world_size=2,
            cache_dir=tmp_path / f"node{rank}", write=True, all_gather_object=gather_for(rank))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    forwards = [m.calls - c for m, c in zip(modules, calls)]
    assert forwards == [2, 2]  # 4 batches of <= 2 over two ranks, on both ranks
    assert results[0].ids == results[1].ids == sorted(ex.id for ex in examples)
    assert torch.equal(results[0].values, results[1].values)
    assert store_path(tmp_path / "node1", "t", f.digest).is_file()


# ------------------------------------------------------------------------------- c_base
def test_c_base_sum_mode_is_token_sum_per_example_then_mean():
    examples = make_examples(7, seed=5)
    values = compute_reference_store(PrefixMeanLM(), [collate(examples, TOKENS)], rank=0, world_size=1)
    store = ReferenceStore.from_values(values, fingerprint="f" * 64)
    ids = [ex.id for ex in examples]
    by_hand_sum = sum(sum(float(v) for v in values[i]) for i in ids) / len(ids)
    by_hand_mean = sum(sum(float(v) for v in values[i]) / len(values[i]) for i in ids) / len(ids)
    c_sum, c_mean = c_base_from_store(store, ids, "sum"), c_base_from_store(store, ids, "mean", chunk_size=3)
    assert c_sum.value == pytest.approx(by_hand_sum, rel=1e-12) and c_sum.mode == "sum"
    assert c_mean.value == pytest.approx(by_hand_mean, rel=1e-12) and c_mean.source == "validation"
    assert c_sum.fingerprint == "f" * 64 and c_sum.value > 2 * c_mean.value
    # the online path (per batch, then reduced) gives the same number
    pairs = [c_base_sum_count(*store.lookup(ids[s : s + 2]), "sum") for s in range(0, 7, 2)]
    online = c_base_from_sum_count(sum(p[0] for p in pairs), sum(p[1] for p in pairs), mode="sum", fingerprint="f" * 64)
    assert online.value == pytest.approx(c_sum.value, rel=1e-12)


def test_c_base_token_mode_is_the_global_token_mean():
    """c_base[token] = sum_i sum_t b_it / sum_i n_i over the validation set (issue 21), by hand, from any
    split into batches; it differs from the mean of per-example means when lengths vary."""
    examples = make_examples(7, seed=5)
    values = compute_reference_store(PrefixMeanLM(), [collate(examples, TOKENS)], rank=0, world_size=1)
    store = ReferenceStore.from_values(values, fingerprint="f" * 64)
    ids = [ex.id for ex in examples]
    assert len({len(values[i]) for i in ids}) > 1  # ragged lengths, else token and mean coincide
    by_hand = sum(float(v) for i in ids for v in values[i]) / sum(len(values[i]) for i in ids)
    c_token = c_base_from_store(store, ids, "token", chunk_size=3)
    assert c_token.value == pytest.approx(by_hand, rel=1e-12) and c_token.mode == "token"
    assert c_token.value != pytest.approx(c_base_from_store(store, ids, "mean").value, rel=1e-6)
    pairs = [c_base_sum_count(*store.lookup(ids[s : s + 2]), "token") for s in range(0, 7, 2)]
    assert sum(float(p[1]) for p in pairs) == sum(len(values[i]) for i in ids)
    online = c_base_from_sum_count(sum(p[0] for p in pairs), sum(p[1] for p in pairs), mode="token", fingerprint="f" * 64)
    assert online.value == pytest.approx(by_hand, rel=1e-12)


def test_c_base_of_another_mode_or_fingerprint_is_never_reused():
    stored = CBase(value=0.5, mode="mean", fingerprint="aaa", source="validation")
    fresh = CBase(value=3.0, mode="sum", fingerprint="aaa", source="validation")
    assert resolve_c_base(mode="mean", fingerprint="aaa", stored=stored, user_value=None, recompute=None) is stored
    with pytest.raises(ValueError, match=r"mode='mean'.*mode='sum'"):
        resolve_c_base(mode="sum", fingerprint="aaa", stored=stored, user_value=None, recompute=None)
    with pytest.raises(ValueError, match=r"fingerprint='aaa'.*fingerprint='bbb'"):
        resolve_c_base(mode="mean", fingerprint="bbb", stored=stored, user_value=None, recompute=None)
    calls = []
    got = resolve_c_base(mode="sum", fingerprint="aaa", stored=stored, user_value=None, recompute=lambda: calls.append(1) or fresh)
    assert got == fresh and calls == [1]
    with pytest.raises(ValueError, match="recomputed c_base"):
        resolve_c_base(mode="mean", fingerprint="bbb", stored=stored, user_value=None, recompute=lambda: stored)
    user = resolve_c_base(mode="sum", fingerprint="aaa", stored=stored, user_value=2.5, recompute=None)
    assert (user.value, user.mode, user.source) == (2.5, "sum", "user")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="zfree_reference_scale"):
            resolve_c_base(mode="sum", fingerprint="aaa", stored=None, user_value=bad, recompute=None)
        with pytest.raises(ValueError, match="c_base"):
            CBase(value=bad, mode="mean", fingerprint="aaa", source="validation")
    with pytest.raises(ValueError, match="no c_base"):
        resolve_c_base(mode="sum", fingerprint="aaa", stored=None, user_value=None, recompute=None)
    assert CBase.from_dict(user.to_dict()) == user
    with pytest.raises(ValueError, match="unknown keys"):
        CBase.from_dict({**user.to_dict(), "scale": 1})
    with pytest.raises(ValueError, match="mode"):
        CBase(value=1.0, mode="median", fingerprint="aaa", source="user")


# ------------------------------------------------------------------------------- two real ranks (gloo)
def _gloo_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        module = PrefixMeanLM()
        val = make_examples(7, seed=11)  # odd: 3 batches of 3 over 2 ranks -> rank 1 runs a padding batch
        items = list(iter_reference_batches(val, TOKENS, batch_size=3, rank=rank, world_size=world))
        values = compute_reference_store(module, items, rank=rank, world_size=world)
        sums = torch.zeros(3, 2, dtype=torch.float64)  # rows mean/sum/token, columns (sum, count): the online c_base path
        for batch, keep in items:
            ref, mask = module(batch)
            for m, mode in enumerate(("mean", "sum", "token")):
                if keep:
                    s, c = c_base_sum_count(ref, mask, mode)
                    sums[m] += torch.stack([s, c])
        dist.all_reduce(sums)
        save_file({**{f"b/{k}": v for k, v in values.items()}, "sums": sums}, os.path.join(out_dir, f"rank{rank}.safetensors"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process(tmp_path):
    from safetensors.torch import load_file

    torch.multiprocessing.spawn(_gloo_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    torch.manual_seed(0)
    module = PrefixMeanLM()
    val = make_examples(7, seed=11)
    single = compute_reference_store(module, iter_reference_batches(val, TOKENS, batch_size=7, rank=0, world_size=1), rank=0, world_size=1)
    store = ReferenceStore.from_values(single, fingerprint="s")
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        assert {k[2:] for k in got if k.startswith("b/")} == set(single)  # every rank holds all b
        for ex_id, b in single.items():
            torch.testing.assert_close(got[f"b/{ex_id}"], b, rtol=0, atol=1e-6)
        for m, mode in enumerate(("mean", "sum", "token")):
            total, count = got["sums"][m].tolist()
            assert count == (sum(len(b) for b in single.values()) if mode == "token" else 7)
            want = c_base_from_store(store, [ex.id for ex in val], mode).value
            assert c_base_from_sum_count(total, count, mode=mode, fingerprint="s").value == pytest.approx(want, rel=1e-6)


# ------------------------------------------------------------------------------- what the trainer holds
def test_provider_online_and_precomputed_agree(tmp_path, llama):
    llama.save_pretrained(tmp_path / "backbone")
    train, val = make_examples(8, seed=21, prefix="tr"), make_examples(5, seed=22, prefix="va")
    module = LlamaReference(llama)
    engine = SimpleNamespace(
        module=module, all_reduce=lambda t, op="sum": t.clone(),
        info=SimpleNamespace(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
    )
    model = SimpleNamespace(tokens=TOKENS, tokenizer={f"t{i}": i for i in range(VOCAB)})

    def cfg(policy, scale=None, mode="sum"):
        return TrainConfig.from_flat(reference_policy=policy, reference_cache_dir=str(tmp_path / "cache"), micro_batch_size=3,
                                     reconstruction_loss_token_aggregation_mode=mode, zfree_reference_scale=scale, precision="fp32", seed=0)

    def build(c, passes=2.0):
        return ReferenceProvider.build(c, engine=engine, model=model, backbone=tmp_path / "backbone", train=train, val=val, passes=passes)

    pre, online = build(cfg("auto")), build(cfg("auto"), passes=1.0)
    assert (pre.policy, online.policy) == ("precomputed", "online")
    assert pre.c_base.value == pytest.approx(online.c_base.value, rel=1e-5) and pre.c_base.mode == "sum"
    assert pre.c_base.fingerprint == online.c_base.fingerprint == pre.fingerprints["validation"]
    for exs in (train[:4], val[:3]):
        batch = collate(exs, TOKENS)
        torch.testing.assert_close(pre.ref_nll(engine, batch), online.ref_nll(engine, batch), rtol=0, atol=1e-5)
    calls = module.calls
    again = build(cfg("precomputed"))  # both stores come from the cache: no forward at all
    assert module.calls == calls and again.c_base == pre.c_base
    user = build(cfg("online", scale=1.5))
    assert module.calls == calls and (user.c_base.value, user.c_base.source) == (1.5, "user")
    assert build(cfg("precomputed", mode="mean")).c_base.value < pre.c_base.value


class PlantedReference(nn.Module):
    """``module(batch, mode="reference")`` returning b planted per example id (what the provider's passes read)."""

    def __init__(self, b_by_id: dict[str, torch.Tensor]):
        super().__init__()
        self.planted = ReferenceStore.from_values(b_by_id, fingerprint="planted")

    def forward(self, batch, mode: str = "reference"):
        assert mode == "reference"
        return self.planted.lookup(batch.ids, n_span=int(batch.num_supervised.max()))


@pytest.mark.parametrize("policy", ["precomputed", "online"])
def test_provider_finds_the_degenerate_weights_its_setup_passes_see(tmp_path, policy):
    from safetensors.torch import save_file

    (tmp_path / "backbone").mkdir()
    save_file({"w": torch.zeros(1)}, str(tmp_path / "backbone" / "model.safetensors"))
    train, val = make_examples(6, seed=31, prefix="tr"), make_examples(5, seed=32, prefix="va")

    def planted(ex):
        n = len(ex.y_ids) + 1  # y and </y>
        if ex.id in ("tr1", "va2"):
            return torch.zeros(n)  # degenerate
        if ex.id in ("tr4", "va0"):
            return torch.full((n,), 1e-3)  # nearly degenerate
        return torch.linspace(0.1, 2.0, n)

    module = PlantedReference({ex.id: planted(ex) for ex in train + val})
    engine = SimpleNamespace(module=module, all_reduce=lambda t, op="sum": t.clone(),
                             info=SimpleNamespace(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    model = SimpleNamespace(tokens=TOKENS, tokenizer={f"t{i}": i for i in range(VOCAB)})

    def build(**kw):
        cfg = TrainConfig.from_flat(reference_policy=policy, reference_cache_dir=str(tmp_path / "cache"), micro_batch_size=2, **kw)
        return ReferenceProvider.build(cfg, engine=engine, model=model, backbone=tmp_path / "backbone", train=train, val=val,
                                       passes=1.0)

    found = build().degenerate_weights
    if policy == "precomputed":  # the store holds b of both splits
        assert (found.splits, found.num_examples) == ("train and validation", 11)
        assert (found.degenerate, found.nearly_degenerate) == (["tr1", "va2"], ["tr4", "va0"])
    else:  # online: only the validation b of the c_base pass
        assert (found.splits, found.num_examples) == ("validation", 5)
        assert (found.degenerate, found.nearly_degenerate) == (["va2"], ["va0"])
        assert build(zfree_reference_scale=1.0).degenerate_weights is None  # no pass computed b at setup

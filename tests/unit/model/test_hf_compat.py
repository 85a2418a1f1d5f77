"""One test per transformers / peft internal that ``zcvae.model.hf_compat`` relies on.

After an upgrade these fail first, and each failure message names the upstream assumption that
broke, so the fix starts in ``model/hf_compat.py`` rather than in a wrong loss far away.
Shape legend: B rows, T tokens, P prefix columns, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from zcvae.model import hf_compat

V = 40


def _ids(B: int = 2, T: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _peft(lm, *, trainable_tokens: list[int] | None = None):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                        trainable_token_indices=trainable_tokens)
    model = get_peft_model(lm, config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:  # LoRA B starts at zero: move every adapter away from a no-op
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


def test_peft_tuner_layers_pass_through_when_disable_adapters_is_set(tiny_llama):
    from peft.tuners.tuners_utils import BaseTunerLayer

    ids = _ids()
    lm = tiny_llama(V)
    with torch.no_grad():
        base_VT = lm(input_ids=ids).logits
    model = _peft(lm, trainable_tokens=[3, 5])
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers and all(hasattr(m, "_disable_adapters") for m in layers), (
        "peft: BaseTunerLayer no longer has the `_disable_adapters` flag that adapters_disabled flips"
    )
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with hf_compat.adapters_disabled(model):
            disabled = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert not torch.allclose(adapted, base_VT), "the perturbed adapters must change the logits"
    assert torch.equal(disabled, base_VT), (
        "peft: a tuner layer with `_disable_adapters = True` no longer passes its input through "
        "(LoRA or trainable tokens still act), so the reference pass would not be the frozen backbone"
    )
    assert torch.equal(again, adapted), "adapters_disabled did not restore the `_disable_adapters` flags"
    assert {n: p.requires_grad for n, p in model.named_parameters()} == trainable, "adapters_disabled must never touch requires_grad"


def test_a_copied_adapter_is_frozen_inactive_and_scores_as_its_source_when_active(tiny_llama):
    ids = _ids()
    model = _peft(tiny_llama(V), trainable_tokens=[3, 5])
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    rng = torch.get_rng_state()
    hf_compat.add_adapter_copy(model, "twin")
    assert torch.equal(torch.get_rng_state(), rng), "add_adapter_copy must fork peft's draw of the new LoRA A off the global RNG"
    assert hf_compat.has_adapter(model, "twin") and not hf_compat.has_adapter(model, "other")
    copy = hf_compat.adapter_parameters(model, "twin")
    trained = hf_compat.adapter_parameters(model, "default")
    assert copy.keys() == trained.keys() and any(hf_compat.TRAINABLE_TOKENS_DELTA in k for k in copy), (
        "peft: adapter_layer_names no longer name the per-adapter weights (lora_A/lora_B, trainable_tokens_delta)"
    )
    assert not any(p.requires_grad for p in copy.values()), "peft: add_adapter left the new adapter trainable"
    assert {n: p.requires_grad for n, p in model.named_parameters() if n in trainable} == trainable
    with torch.no_grad():
        still = model(input_ids=ids).logits
        with hf_compat.adapter_active(model, "twin"):
            copied = model(input_ids=ids).logits
        for p in trained.values():
            p.add_(0.5)  # the trained adapter moves on; the copy stays
        with hf_compat.adapter_active(model, "twin"):
            stale = model(input_ids=ids).logits
        hf_compat.copy_adapter(model, target="twin")
        with hf_compat.adapter_active(model, "twin"):
            renewed = model(input_ids=ids).logits
        moved = model(input_ids=ids).logits
    assert torch.equal(still, adapted), "adding an adapter must not change what the active one computes"
    assert torch.equal(copied, adapted), (
        "peft: a tuner layer whose `_active_adapter` names the copy does not compute what the source adapter did"
    )
    assert torch.equal(stale, adapted) and torch.equal(renewed, moved) and not torch.equal(moved, adapted)
    assert {n: p.requires_grad for n, p in model.named_parameters() if n in trainable} == trainable, "adapter_active must never touch requires_grad"


def test_peft_names_the_trainable_token_rows_trainable_tokens_delta(tiny_llama):
    model = _peft(tiny_llama(V), trainable_tokens=[3, 5])
    names = [n for n, p in model.named_parameters() if p.requires_grad and hf_compat.TRAINABLE_TOKENS_DELTA in n]
    assert names, (
        f"peft: no trainable parameter named '*{hf_compat.TRAINABLE_TOKENS_DELTA}*' for trainable_token_indices; "
        "the z rows would fall out of the 'latent' optimizer group"
    )
    assert all(p.shape[0] == 2 for n, p in model.named_parameters() if n in names), "one delta row per trainable token"


def test_replay_safe_cache_records_the_prefix_and_extends_it_without_appending(tiny_llama):
    lm = tiny_llama(V)
    ids_BT, P = _ids(), 4
    T = ids_BT.shape[1]
    params = hf_compat.forward_parameter_names(lm)
    assert "position_ids" in params and hf_compat.cache_kwarg(params) in params, (
        f"transformers: {type(lm).__name__}.forward takes no `position_ids` or no `cache`/`past_key_values`"
    )
    key = hf_compat.cache_kwarg(params)
    with torch.no_grad():
        full_BTV = lm(input_ids=ids_BT).logits
        record = hf_compat.replay_safe_cache()
        lm(input_ids=ids_BT[:, :P], use_cache=True, **{key: record})
        kv = hf_compat.recorded_kv(record)
        assert len(kv) == lm.config.num_hidden_layers and all(k.shape[-2] == P for k, _ in kv), (
            "transformers: Cache(layer_class_to_replicate=...) no longer builds one recording DynamicLayer per "
            "layer, or DynamicLayer.update no longer receives each layer's keys/values"
        )
        positions = torch.arange(P, T)[None].expand(ids_BT.shape[0], -1)
        suffix = [lm(input_ids=ids_BT[:, P:], position_ids=positions, use_cache=True, **{key: hf_compat.replay_safe_cache(kv)}).logits
                  for _ in range(2)]
    torch.testing.assert_close(suffix[0], full_BTV[:, P:], atol=1e-5, rtol=1e-5,
                               msg="transformers: a suffix forward on Cache(layers=[...]) no longer attends over the given prefix keys/values")
    assert torch.equal(suffix[0], suffix[1]), "the suffix cache changed between calls: a checkpoint replay would see another past"


@pytest.fixture
def checkpointed_llama(tiny_llama):
    lm = tiny_llama(V).train()
    hf_compat.enable_layer_checkpointing(lm)
    return lm


def test_checkpointing_flags_are_where_hf_compat_reads_them(checkpointed_llama):
    from transformers.modeling_layers import GradientCheckpointingLayer

    lm = checkpointed_llama
    layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers, "transformers: LlamaDecoderLayer is no longer a GradientCheckpointingLayer"
    assert all(m.gradient_checkpointing is True for m in layers), (
        "transformers: gradient_checkpointing_enable() no longer sets `gradient_checkpointing = True` on the layers"
    )
    assert GradientCheckpointingLayer._can_checkpoint_with_cache is False, (
        "transformers: GradientCheckpointingLayer._can_checkpoint_with_cache is gone or no longer False by default"
    )
    assert hf_compat.layer_checkpointing_active(lm) and hf_compat.checkpointing_layers(lm)
    assert not hf_compat.layer_checkpointing_active(lm.eval()), "eval mode does not checkpoint"
    lm.train()
    with hf_compat.layer_checkpointing_off(lm):
        assert not hf_compat.layer_checkpointing_active(lm)
    assert all(m.gradient_checkpointing is True for m in layers), "layer_checkpointing_off did not restore the flags"


def test_the_cache_reaches_checkpointed_layers_and_the_backward_is_exact(tiny_llama, checkpointed_llama):
    from transformers.modeling_layers import GradientCheckpointingLayer

    ids_BT, P = _ids(), 5
    key = hf_compat.cache_kwarg(hf_compat.forward_parameter_names(checkpointed_llama))

    def loss_and_grads(lm):
        lm.zero_grad(set_to_none=True)
        record = hf_compat.replay_safe_cache()
        with hf_compat.cache_through_checkpointing(lm):
            lm(input_ids=ids_BT[:, :P], use_cache=True, **{key: record})
            kv = hf_compat.recorded_kv(record)
            positions = torch.arange(P, ids_BT.shape[1])[None].expand(ids_BT.shape[0], -1)
            out = lm(input_ids=ids_BT[:, P:], position_ids=positions, use_cache=True, **{key: hf_compat.replay_safe_cache(kv)})
        loss = out.logits.float().logsumexp(-1).sum()
        loss.backward()
        return len(kv), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    num_layers, ckpt = loss_and_grads(checkpointed_llama)
    assert num_layers == checkpointed_llama.config.num_hidden_layers, (
        "transformers: a checkpointed layer dropped the cache although `_can_checkpoint_with_cache` was set "
        "(cache_through_checkpointing no longer lets the replay-safe cache through)"
    )
    assert all("_can_checkpoint_with_cache" not in vars(m) for m in checkpointed_llama.modules() if isinstance(m, GradientCheckpointingLayer)), (
        "cache_through_checkpointing left the instance flag behind"
    )
    _, plain = loss_and_grads(tiny_llama(V).train())
    assert plain.keys() == ckpt.keys() and plain
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, atol=1e-5, rtol=1e-5,
                                   msg=f"{name}: the checkpoint replay through the shared cache changed the gradient")


def test_trainable_token_layers_read_the_full_weight_of_their_base_layer(tiny_llama):
    lm = tiny_llama(V)
    embedding = lm.get_input_embeddings().weight
    model = _peft(lm, trainable_tokens=[3, 5])
    found = hf_compat.trainable_token_base_weights(model)
    assert found and any(weight is embedding for _, weight in found), (
        "peft: TrainableTokensLayer no longer keeps the embedding it wraps as `base_layer` "
        "(ZeRO-3 would not gather the weight the layer reads)"
    )
    assert all(weight.shape[0] == V for _, weight in found), "a base weight is the full matrix, one row per token"


def test_embedding_weight_sees_through_the_trainable_token_wrapper(tiny_llama):
    lm = tiny_llama(V)
    embedding = lm.get_input_embeddings()
    assert hf_compat.embedding_weight(embedding) is embedding.weight
    model = _peft(lm, trainable_tokens=[3, 5])
    assert model.get_input_embeddings() is not embedding, "peft no longer wraps the embedding: this test checks nothing"
    assert hf_compat.embedding_weight(model.get_input_embeddings()) is embedding.weight, (
        "peft: the trainable-token wrapper no longer holds the embedding at `token_adapter.base_layer`"
    )


def test_adapter_config_is_the_lora_config_the_model_was_built_with(tiny_llama):
    from peft import LoraConfig

    config = hf_compat.adapter_config(_peft(tiny_llama(V)))
    assert isinstance(config, LoraConfig) and config.r == 2 and set(config.target_modules) == {"q_proj", "v_proj"}, (
        "peft: `peft_config[active_adapter]` is no longer the model's LoraConfig"
    )


def test_no_split_module_names_name_the_decoder_layers(tiny_llama):
    model = _peft(tiny_llama(V))
    names = hf_compat.no_split_module_names(model)
    assert names == {"LlamaDecoderLayer"}, f"transformers: Llama's `_no_split_modules` is {names}, FSDP2 shards by it"
    assert hf_compat.no_split_module_names(torch.nn.Linear(2, 2)) == set()


def test_lm_decoder_is_the_model_without_its_head(tiny_llama):
    model = _peft(tiny_llama(V))
    decoder = hf_compat.lm_decoder(model)
    assert decoder is not None, "transformers: LlamaForCausalLM.base_model is no longer its decoder"
    ids = _ids()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = decoder(input_ids=ids).last_hidden_state
        head_logits = model.get_output_embeddings()(hidden)
    torch.testing.assert_close(head_logits, logits, msg="transformers: head(base_model(...).last_hidden_state) is no longer the LM's logits")


def test_disable_dropout_also_zeroes_the_float_attention_dropout(tiny_llama):
    lm = tiny_llama(V).train()
    attention = [m for m in lm.modules() if isinstance(getattr(m, "attention_dropout", None), float)]
    assert attention, "transformers: Llama attention no longer keeps its dropout in a float `attention_dropout`"
    for m in attention:
        m.attention_dropout = 0.5
    ids = _ids()
    with torch.no_grad():
        torch.manual_seed(0)
        first = lm(input_ids=ids).logits
        torch.manual_seed(1)
        assert not torch.equal(lm(input_ids=ids).logits, first), "attention_dropout 0.5 must make the training forward random"
        hf_compat.disable_dropout(lm)
        torch.manual_seed(0)
        first = lm(input_ids=ids).logits
        torch.manual_seed(1)
        assert torch.equal(lm(input_ids=ids).logits, first), "a training forward still drops out after disable_dropout"


def test_position_limit_reads_each_architectures_name():
    from types import SimpleNamespace

    from transformers import GPT2Config, LlamaConfig

    assert hf_compat.position_limit(LlamaConfig(max_position_embeddings=64)) == 64
    assert hf_compat.position_limit(GPT2Config(n_positions=32)) == 32
    assert hf_compat.position_limit(SimpleNamespace(n_ctx=16)) == 16
    assert hf_compat.position_limit(SimpleNamespace(max_position_embeddings=None)) is None
    assert hf_compat.position_limit(None) is None


def test_decoder_norms_are_each_layers_two_norms_in_order(tiny_llama):
    from transformers import GPT2Config, GPT2LMHeadModel

    lm = tiny_llama(V)
    layers = hf_compat.decoder_layers(lm)
    assert len(layers) == lm.config.num_hidden_layers
    assert hf_compat.decoder_norms(lm) == [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)], (
        "transformers: a Llama layer no longer holds input_layernorm and post_attention_layernorm as its own norms")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    assert hf_compat.decoder_norms(gpt2) == [n for block in gpt2.transformer.h for n in (block.ln_1, block.ln_2)]
    with pytest.raises(ValueError, match="no norm found inside the decoder layers"):
        hf_compat.decoder_norms(torch.nn.Sequential(torch.nn.Linear(2, 2)))


class _VHTensorsMade(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the (V, H) or (H, V) tensors that any op makes in memory of its own (a merged weight, a
    dense weight gradient), not views of the model's parameters (a transposed head)."""

    def __init__(self, model, shape):
        super().__init__()
        self.shape, self.count = sorted(shape), 0
        self.parameter_storage = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and sorted(t.shape) == self.shape
                    and t.untyped_storage().data_ptr() not in self.parameter_storage):
                self.count += 1
        return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_copy_free_token_layers_give_peft_s_logits_and_gradients_without_a_vh_tensor(tiny_llama, tied):
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    rows = [3, 5, 11]
    ids = _ids()
    ids[0, :3] = torch.tensor(rows)  # every trained token in use, one twice
    ids[1, -1] = rows[0]

    def build():
        lm = tiny_llama(V)
        if tied:
            lm.config.tie_word_embeddings = True
            lm.tie_weights()
        return _peft(lm, trainable_tokens=rows)

    def run(model):
        weight = next(m for m in model.modules() if isinstance(m, TrainableTokensLayer)).base_layer.weight
        with _VHTensorsMade(model, weight.shape) as made:
            logits = model(input_ids=ids).logits
            (logits.float().square().mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return logits.detach(), grads, made.count

    peft_model = build()
    peft_logits, peft_grads, peft_made = run(peft_model)
    model = build()
    layers = [m for m in model.modules() if isinstance(m, TrainableTokensLayer)]
    kinds = {type(m.base_layer) for m in layers}
    assert kinds == ({torch.nn.Embedding, torch.nn.Linear} if tied else {torch.nn.Embedding}), \
        f"peft: the trainable-token layers are no longer over the embedding (and a tied head): {kinds}"
    assert hf_compat.copy_free_token_layers(model) == len(layers)
    logits, grads, made = run(model)
    torch.testing.assert_close(logits, peft_logits, rtol=1e-5, atol=1e-6)
    assert grads.keys() == peft_grads.keys() and any("trainable_tokens_delta" in n for n in grads)
    for name, g in peft_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert peft_made > 0, "peft no longer makes a (V, H) copy or gradient: the correction may be moot"
    assert made == 0, f"the corrected layers made {made} (V, H) tensors"
    with torch.no_grad(), hf_compat.adapters_disabled(model), hf_compat.adapters_disabled(peft_model):  # the base, as peft's
        base = model(input_ids=ids).logits
        torch.testing.assert_close(base, peft_model(input_ids=ids).logits)
        assert not torch.allclose(base, logits, atol=1e-3), "the trained rows must change some logits"


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``fn()`` runs (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t):
        if not (t.is_leaf and t.requires_grad):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _lora_model(tiny_llama, dtype):
    from peft import LoraConfig, get_peft_model

    lm = tiny_llama(V, hidden_size=64, num_heads=4).to(dtype)
    model = get_peft_model(lm, LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.data = (p.float() + 0.5 * torch.randn(p.shape, generator=g))  # float32 adapters, moved off a no-op
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-base", "fp32-base"])
def test_shared_lora_input_casts_save_one_copy_for_q_k_v_and_change_no_value(tiny_llama, dtype):
    import copy

    ids = _ids(B=2, T=9)
    peft_own = _lora_model(tiny_llama, dtype)
    shared = copy.deepcopy(peft_own)
    assert hf_compat.share_lora_input_casts(shared) == 2 * 4, "peft: the LoRA layers are no longer peft.tuners.lora.LoraLayer"
    runs = []
    for model in (peft_own, shared):
        logits, saved = _saved_bytes(lambda m=model: m(input_ids=ids).logits.float())
        logits.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        runs.append((logits.detach(), saved, grads))
    (own_logits, own_saved, own_grads), (logits, saved, grads) = runs
    assert torch.equal(logits, own_logits), "the shared cast must be the same value as peft's own"
    tokens, H, L = ids.numel(), 64, 2
    if dtype == torch.float32:  # no cast at all: the same graph
        assert saved == own_saved and all(torch.equal(grads[n], own_grads[n]) for n in grads)
        return
    # q, k and v read one float32 copy of their input instead of three: two H-wide float32 copies fewer per layer
    assert own_saved - saved == L * 2 * tokens * H * 4, (
        "peft: LoRA layers no longer cast their input through BaseTunerLayer._cast_input_dtype, or not once each")
    # the hidden state's gradient is summed in float32 before its one rounding to bf16: bf16-close, not equal
    for n in grads:
        torch.testing.assert_close(grads[n], own_grads[n], rtol=2e-2, atol=2e-2 * own_grads[n].abs().max().item())


def test_under_autocast_a_lora_layer_reads_its_bf16_input_as_it_is(tiny_llama):
    """The local engine's bf16 precision with a bf16 base: peft cast the input to float32 and autocast cast it back
    to bf16, saving one bf16 copy per LoRA layer; without the cast the layers save none, with the same logits."""
    import copy

    ids = _ids(B=2, T=9)
    peft_own = _lora_model(tiny_llama, torch.bfloat16)
    shared = copy.deepcopy(peft_own)
    hf_compat.share_lora_input_casts(shared)
    runs = []
    for model in (peft_own, shared):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, saved = _saved_bytes(lambda m=model: m(input_ids=ids).logits.float())
        logits.square().mean().backward()
        runs.append((logits.detach(), saved, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (own_logits, own_saved, own_grads), (logits, saved, grads) = runs
    assert torch.equal(logits, own_logits)
    tokens, H, L = ids.numel(), 64, 2
    # q, k, v and o each saved a bf16 copy of its input; now each saves its input itself, which for q, k and v is
    # one tensor (measured: three copies fewer per layer; at least the two that sharing must remove)
    assert own_saved - saved >= L * 2 * tokens * H * 2, (own_saved, saved)
    for n in grads:
        torch.testing.assert_close(grads[n], own_grads[n], rtol=2e-2, atol=2e-2 * own_grads[n].abs().max().item())


def test_lora_wrapped_draws_lora_from_its_seed_keeps_the_global_rng_and_is_quiet(tiny_llama):
    import warnings

    from peft import LoraConfig

    def lora_a(lm, seed: int) -> dict[str, torch.Tensor]:
        config = LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
        model = hf_compat.lora_wrapped(lm, config, seed=seed)
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    lms = [tiny_llama(V) for _ in range(3)]
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = lora_a(lms[0], seed=5)
    assert torch.equal(torch.rand(3), expected_next), "lora_wrapped moved the global RNG state"
    again, other = lora_a(lms[1], seed=5), lora_a(lms[2], seed=6)
    assert first and all(torch.equal(first[n], again[n]) for n in first), "the same seed must give the same LoRA A"
    assert any(not torch.equal(first[n], other[n]) for n in first), "another seed must give another LoRA A"
    noisy = [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert not noisy, f"peft's wrap warned about transformers' deprecated flag: {noisy}"

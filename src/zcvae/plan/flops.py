"""The LoRA-aware FLOP model of one CVAE (or plain LoRA) step: the one home of ``Shape`` and ``step_flops``
(``bench/step_bench.py``, ``bench/gpu_check.py`` and ``zcvae plan`` read it).

A trained pass costs forward 2 N_frozen per token plus backward 2 N_frozen (activation gradients only:
frozen weights get no weight gradient), attention scores 3x their forward, adapters 3x theirs; a no-grad
pass costs its forward. "useful" counts the trained passes, "hardware" adds the online reference forward.

Shape legend: B examples, K branches, T z-free length, P prefix length, W suffix length.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shape", "lora_parameters", "numel", "step_flops"]


def numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 leaves an empty local shard in p


def _dims(cfg) -> tuple[int, int, int, int, int]:
    """(H, L, I, q width = heads x head_dim, kv width) of a Hugging Face config."""
    H, L, I = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return H, L, I, cfg.num_attention_heads * head_dim, kv_heads * head_dim


def lora_parameters(cfg, *, r: int, targets) -> int:
    """LoRA parameters (A and B) of rank ``r`` on the Llama-style projections named in ``targets``."""
    H, L, I, q, kv = _dims(cfg)
    shapes = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
              "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}  # (in, out)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"lora_target_modules: no shape known for {unknown} (known: {sorted(shapes)})")
    return L * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


@dataclass
class Shape:
    """Per-token FLOP coefficients of the backbone (forward, multiply-add = 2 FLOPs)."""

    linear: float  # 2 x frozen matmul parameters of the decoder layers
    head: float  # 2 x V x H (lm_head)
    lora: float  # 2 x adapter parameters
    attn: float  # 2 x 2 x (heads x head_dim) x layers: scores + weighted sum, per attended key

    @classmethod
    def from_config(cls, cfg, *, lora_params: int) -> "Shape":
        """From a Hugging Face config (``hidden_size``, ``num_hidden_layers``, ...) and the adapter size."""
        H, L, I, q, kv = _dims(cfg)
        per_layer = H * q * 2 + 2 * H * kv + 3 * H * I
        return cls(linear=2.0 * L * per_layer, head=2.0 * cfg.vocab_size * H, lora=2.0 * lora_params, attn=4.0 * q * L)

    @classmethod
    def of(cls, model) -> "Shape":
        """From a built :class:`~zcvae.model.cvae.ZCVAE` (its backbone's config and its LoRA parameters)."""
        lora = sum(numel(p) for n, p in model.peft_model.named_parameters() if "lora_" in n)
        return cls.from_config(model.peft_model.get_base_model().config, lora_params=lora)

    def forward(self, *, rows: int, queries: int, keys_before: int = 0, head_tokens: int | None = None) -> tuple[float, float, float]:
        """(frozen, adapter, attention) forward FLOPs of ``rows`` x ``queries`` tokens after a cached
        ``keys_before`` (causal: query j sees keys_before + j + 1 keys)."""
        tokens = rows * queries
        attended = rows * (queries * keys_before + queries * (queries + 1) / 2)
        head = self.head * (tokens if head_tokens is None else head_tokens)
        return self.linear * tokens + head, self.lora * tokens, self.attn * attended

    @staticmethod
    def trained(f: tuple[float, float, float]) -> float:
        frozen, adapter, attention = f
        return 2 * frozen + 3 * adapter + 3 * attention

    @staticmethod
    def nograd(f: tuple[float, float, float]) -> float:
        return sum(f)


def step_flops(shape: Shape, *, kind: str, B: int, x_len: int, y_len: int, K: int, share: bool, online: bool, slots: int = 1) -> tuple[float, float]:
    """(useful, hardware) FLOPs of one step; the online reference forward is hardware-only.

    ``kind``: "cvae" (router pass + B*K branches), "lora" (one trained pass of the z-free template) or
    "reference" (its no-grad forward alone)."""
    T = x_len + y_len + 6  # bos <x> x </x> <y> y </y> eos
    P, Wy, Wz = x_len + 3, y_len + 3, y_len + 5 + slots  # prefix, z-free suffix, z-conditioned suffix
    S = P + Wz
    ref = shape.nograd(shape.forward(rows=B, queries=T))
    if kind == "reference":
        return 0.0, ref
    if kind == "lora":
        return shape.trained(shape.forward(rows=B, queries=T)), shape.trained(shape.forward(rows=B, queries=T))
    if share:
        useful = shape.trained(shape.forward(rows=B, queries=P, head_tokens=B))
        useful += shape.trained(shape.forward(rows=B, queries=Wy, keys_before=P))
        useful += shape.trained(shape.forward(rows=B * K, queries=Wz, keys_before=P))
    else:
        useful = shape.trained(shape.forward(rows=B, queries=T)) + shape.trained(shape.forward(rows=B * K, queries=S))
    return useful, useful + (ref if online else 0.0)

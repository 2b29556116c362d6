"""Seed-OSS (`seed_oss`, SeedOssForCausalLM: ByteDance-Seed/Seed-OSS-36B-Base, -Instruct):
llama with separate bias switches for the q/k/v and output projections.

What differs from llama:
- q/k/v carry biases with `attention_bias` (default True), o_proj with
  `attention_out_bias` (default False), the MLP with `mlp_bias`.
- transformers' defaults: head_dim 128, rms_norm_eps 1e-6. The attention and residual
  dropouts only act in training and are not read.
Reference: transformers `models/seed_oss/modeling_seed_oss.py`, `configuration_seed_oss.py`.
"""

from dataclasses import dataclass

from . import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    """SeedOssConfig's keys (llama's plus attention_out_bias), with its defaults."""

    head_dim: int = 128
    attention_bias: bool = True
    attention_out_bias: bool = False

    @property
    def o_bias(self) -> bool:  # read by llama.Attention
        return self.attention_out_bias


class Model(llama.Model):
    """llama's network; only ModelArgs differs."""

    # KV caches roll back by themselves; the layers record nothing.
    supports_speculative_rollback = True

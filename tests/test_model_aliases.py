"""MODEL_REMAPPING (utils.py): every model_type alias resolves through get_model_classes to
the classes of the family it names, and an XVERSE config (upstream's "xverse" -> llama)
builds llama's network from XverseConfig's keys (multi-head, rope base 10000)."""

import importlib

import mlx.core as mx
import pytest

from mlx_lm.models import llama
from mlx_lm.utils import MODEL_REMAPPING, get_model_classes


@pytest.mark.parametrize("alias", sorted(MODEL_REMAPPING))
def test_alias_resolves_to_its_family(alias):
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING[alias]}")
    assert get_model_classes({"model_type": alias}) == (module.Model, module.ModelArgs)


def test_xverse_is_llama():
    config = dict(model_type="xverse", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-6,
                  vocab_size=256, tie_word_embeddings=False)
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    assert isinstance(model, llama.Model)
    assert (model.args.num_key_value_heads, model.args.rope_theta, model.args.layer_types) == (
        4, 10000.0, ["full_attention"] * 2)
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 256)

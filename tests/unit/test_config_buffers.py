"""Non-persistent buffers of a meta-built model recomputed from its modules' configs
(``tpcompile.state.config_buffers``), and the errors for buffers no config determines."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpcompile.errors import TPCompileError
from tpcompile.state.config_buffers import config_buffers

tf = pytest.importorskip("transformers")

ROPE = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]


def llama_config():
    return tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, rope_parameters={"rope_type": "linear",
                                                                       "rope_theta": 500.0,
                                                                       "factor": 2.0})


def test_hf_rope_tables_equal_the_eagerly_built_model():
    """Scaled RoPE (not the default tables): the values come from the config, not a guess."""
    eager = tf.LlamaForCausalLM(llama_config())
    with torch.device("meta"):
        meta = tf.LlamaForCausalLM(llama_config())
    got = config_buffers(meta, ROPE)
    for name in ROPE:
        assert got[name].device.type == "cpu"
        assert torch.equal(got[name], eager.get_buffer(name)), name


class Config:
    dim = 4


class Random(nn.Module):
    """A module built from a config whose buffer is drawn at random: no config determines it."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.register_buffer("noise", torch.randn(config.dim), persistent=False)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4.0), persistent=False)


class Holder(nn.Module):
    """A config-built parent of a module that keeps no config: the parent is rebuilt."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.inner = Plain()


def test_a_module_without_config_is_rebuilt_through_its_configured_parent():
    with torch.device("meta"):
        meta = Holder(Config())
    assert torch.equal(config_buffers(meta, ["inner.table"])["inner.table"], torch.arange(4.0))


def test_a_random_buffer_is_an_error_naming_it():
    with torch.device("meta"):
        meta = nn.Sequential(Random(Config()))
    with pytest.raises(TPCompileError, match=r"(?s)buffer 0\.noise .*Random\(config\) does not "
                                             r"compute it the same on two builds.*buffers_of"):
        config_buffers(meta, ["0.noise"])


def test_no_config_anywhere_is_an_error_naming_the_buffer():
    with torch.device("meta"):
        meta = nn.Sequential(Plain())
    with pytest.raises(TPCompileError, match=r"buffer 0\.table .*0 has no \.config; "
                                             r"the model has no \.config"):
        config_buffers(meta, ["0.table"])

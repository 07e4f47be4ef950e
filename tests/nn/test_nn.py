"""jax_flashcomm.nn layers on their own (shard_call), on Explicit and Auto meshes: each
strategy against the unsharded computation, the flash strategy bit-equal to jax_flashcomm.psum
of the same partial products, sequence-parallel against replicated, parameter specs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import nn

SEQ = P(None, "tp", None)


def _mlp(mesh, kind, **comm):
    mlp = nn.TPMLP(64, 100, tp=mesh.shape["tp"], comm=nn.TPComm.from_kind(kind, **comm),
                   rngs=nnx.Rngs(0))
    return nn.place(mlp, mesh)


def _reference_mlp(mlp, x):
    """The MLP computed unsharded from its global parameters (padding units are zero)."""
    gate_up = np.asarray(mlp.gate_up.kernel[...])
    n = mlp.gate_up.tp
    f = mlp.ffn_local
    blocks = gate_up.reshape(64, n, 2, f)
    gate, up = blocks[:, :, 0].reshape(64, n * f), blocks[:, :, 1].reshape(64, n * f)
    h = jax.nn.silu(x @ gate) * (x @ up)
    return h @ np.asarray(mlp.down.kernel[...])


@pytest.mark.parametrize("kind", ["exact", "overlap"])
def test_mlp_matches_unsharded(mesh_factory, kind):
    mesh = mesh_factory((4,), ("tp",))
    mlp = _mlp(mesh, kind)
    x = jax.random.normal(jax.random.key(1), (2, 8, 64))
    spec = SEQ if kind == "overlap" else P()
    y = nn.shard_call(mlp, mesh, (spec,), spec, sp=kind == "overlap")(x)
    np.testing.assert_allclose(y, _reference_mlp(mlp, x), atol=2e-5, rtol=2e-5)


def test_flash_row_parallel_is_flash_psum(mesh_factory):
    """The flash strategy's all-reduce is jax_flashcomm.psum with the TPComm's config."""
    mesh = mesh_factory((4,), ("tp",))
    config = fc.CommConfig(bits=4, min_bytes=0, spikes=1)
    row = nn.place(nn.RowParallelLinear(128, 64, tp=4, comm=nn.TPComm("quantized", config=config),
                                        rngs=nnx.Rngs(0)), mesh)
    x = jax.random.normal(jax.random.key(2), (2, 3, 128))
    y = nn.shard_call(row, mesh, (P(None, None, "tp"),), P())(x)
    direct = jax.shard_map(lambda a, w: fc.psum(a @ w, "tp", config=config), mesh=mesh,
                           in_specs=(P(None, None, "tp"), P("tp", None)), out_specs=P())
    x_sharded = jax.device_put(x, jax.NamedSharding(mesh, P(None, None, "tp")))
    np.testing.assert_array_equal(y, direct(x_sharded, row.kernel[...]))
    exact = x @ row.kernel[...]
    assert 0 < np.abs(np.asarray(y) - np.asarray(exact)).max()


def test_attention_sequence_parallel_matches_replicated(mesh_factory):
    mesh = mesh_factory((4,), ("tp",))
    x = jax.random.normal(jax.random.key(3), (1, 8, 64))
    outs = {}
    for kind in ("exact", "overlap"):
        att = nn.place(nn.TPAttention(64, 8, 2, 16, tp=4, comm=nn.TPComm.from_kind(kind),
                                      rngs=nnx.Rngs(0)), mesh)
        sp = kind == "overlap"
        spec = SEQ if sp else P()
        outs[kind], _ = nn.shard_call(att, mesh, (spec, P()), (spec, None), sp=sp)(
            x, jnp.int32(0))
    np.testing.assert_allclose(outs["overlap"], outs["exact"], atol=2e-5, rtol=2e-5)


def test_param_specs_and_kv_layout():
    att = nn.TPAttention(64, 8, 2, 16, tp=4, comm=nn.TPComm(), rngs=nnx.Rngs(0))
    specs = nn.param_specs(nnx.state(att))
    assert specs["qkv"]["kernel"].get_value() == P(None, "tp")
    assert specs["o"]["kernel"].get_value() == P("tp", None)
    assert att.qkv.kernel[...].shape == (64, 4 * (2 + 2) * 16)   # 2 q + 1 k + 1 v per rank
    assert nn.kv_heads(8, 2, 4) == [0, 0, 1, 1]
    assert nn.kv_heads(8, 4, 2) == [0, 1, 2, 3]
    # 12 query / 2 KV heads over 3 ranks: the middle rank's queries read both KV heads
    assert nn.kv_heads(12, 2, 3) == [0, 0, 0, 1, 1, 1]
    assert nn.kv_heads(12, 2, 4) == [0, 0, 1, 1]
    assert nn.kv_heads(12, 2, 1) == [0, 1]
    assert nn.padded_ffn(100, 8) == 104


def test_layer_errors():
    with pytest.raises(ValueError, match="TP size 3 does not divide the 8 query heads"):
        nn.TPAttention(64, 8, 2, 16, tp=3, comm=nn.TPComm(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="bits=None"):
        nn.TPComm("quantized", config=fc.CommConfig(bits=None))
    with pytest.raises(ValueError, match="does not quantize"):
        nn.TPComm(layout="sequence_parallel", config=fc.CommConfig(bits=4))
    with pytest.raises(ValueError, match="not divisible by the TP size"):
        nn.RowParallelLinear(10, 4, tp=4, comm=nn.TPComm(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind", nn.COMM_KINDS)
def test_a_kind_string_names_a_quantization_and_a_layout(kind):
    options = {} if kind in ("exact", "overlap") else {"bits": 4}
    comm = nn.TPComm.from_kind(kind, **options)
    assert comm.kind == kind
    assert (comm.quantization, comm.layout) == nn.TPComm.parse_kind(kind)
    assert comm.overlap == (comm.layout == "sequence_parallel")
    assert comm == nn.TPComm(comm.quantization, layout=comm.layout, config=comm.config)


def test_unknown_quantization_layout_and_kind():
    with pytest.raises(ValueError, match="unknown quantization 'flash'.*from_kind"):
        nn.TPComm("flash")
    with pytest.raises(ValueError, match="unknown layout 'tp'"):
        nn.TPComm("exact", layout="tp")
    with pytest.raises(ValueError, match="unknown communication kind 'fast'"):
        nn.TPComm.from_kind("fast")
    with pytest.raises(ValueError, match="format='fp8' would be ignored"):
        nn.TPComm("exact", format="fp8")

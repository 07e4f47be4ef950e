"""CommConfig refuses bits that a floating-point phase would ignore (nothing is silently
ignored), and keeps the combinations where the bits apply or agree with the format's own."""

import pytest

import jax_flashcomm as fc


@pytest.mark.parametrize("kw, match", [
    (dict(format="fp8", bits=2, rs_bits=3), "rs_bits=3 with the 'fp8' format"),
    (dict(format="fp8", bits=2), "bits=2 with floating-point formats"),
    (dict(rs_format="nvfp4", rs_bits=3), "rs_bits=3 with the 'nvfp4' format"),
    (dict(format="mxfp4", ag_bits=6), "ag_bits=6 with the 'mxfp4' format"),
])
def test_ignored_bits_are_an_error(kw, match):
    with pytest.raises(ValueError, match=match):
        fc.CommConfig(**kw)


@pytest.mark.parametrize("kw", [
    dict(format="nvfp4"), dict(format="nvfp4", bits=4), dict(format="fp8", bits=8),
    dict(rs_format="nvfp4", bits=4), dict(rs_format="nvfp4", rs_bits=4),
    dict(format="fp8", ag_format="int", ag_bits=4), dict(bits=None),
])
def test_bits_that_apply_or_agree_are_accepted(kw):
    config = fc.CommConfig(**kw)
    assert config.exact or config.phase1_bits is not None

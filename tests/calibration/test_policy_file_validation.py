"""A comm-policy file that is valid JSON with bad fields is a ValueError naming the file and the
field (the CLIs turn it into their one-line error), never a TypeError or RecursionError."""

import json

import pytest

from jax_flashcomm.policy._comm_policy import FILE_KIND, FILE_VERSION, CommPolicy

HEAD = {"kind": FILE_KIND, "version": FILE_VERSION, "default": None}


@pytest.mark.parametrize("fields, match", [
    ({"sites": {"": {"bits": 8}}}, "a site name must be a non-empty string"),
    ({"info": [1, 2]}, "\"info\" must be a JSON object, got list"),
    ({"info": "x"}, "\"info\" must be a JSON object, got str"),
    ({"sites": [1]}, "\"sites\" must map site names"),
])
def test_bad_fields_name_the_file_and_field(tmp_path, fields, match):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({**HEAD, **fields}))
    with pytest.raises(ValueError, match=match) as err:
        CommPolicy.load(path)
    assert str(path) in str(err.value)


def test_a_good_file_loads(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({**HEAD, "sites": {"mlp": {"bits": 8}}, "info": {"a": 1}}))
    policy = CommPolicy.load(path)
    assert policy.config_for("mlp").bits == 8 and policy.info == {"a": 1}

#!/usr/bin/env bash
echo "jax_flashcomm: Bazel coverage tools are not available offline (third_party/offline)" >&2
exit 1

"""Offline stand-in for @rules_java//java:defs.bzl: the native Java rules, unchanged.

Bazel 4 loads @bazel_tools//tools/jdk (its registered Java toolchains, parsed for every build,
C++ included), which loads @rules_java//java:defs.bzl; its default WORKSPACE would fetch
rules_java from GitHub. The WORKSPACE binds @rules_java here instead. No Java is built.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_lite_proto_library(**attrs):
    native.java_lite_proto_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)

def java_package_configuration(**attrs):
    native.java_package_configuration(**attrs)

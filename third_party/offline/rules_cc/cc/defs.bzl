"""Offline stand-in for @rules_cc//cc:defs.bzl: the native C++ rules, unchanged.

Bazel 4's own @bazel_tools//tools/cpp (the auto-configured C++ toolchain) loads
@rules_cc//cc:defs.bzl, and its default WORKSPACE fetches rules_cc from GitHub when the
workspace does not define it. The WORKSPACE binds @rules_cc here instead, so nothing is
downloaded. (The real rules_cc of Bazel 4 is the same thin wrapper over the native rules.)
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)

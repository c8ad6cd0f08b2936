"""Kernel configurations and Jinja rendering (no nvcc, no GPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flashinfer_h3.jit import (
    OP_SOURCES,
    JitError,
    KernelConfig,
    TemplateNotFoundError,
    UnsupportedArchError,
    make_spec,
    render_templates,
    templates_dir,
)
from flashinfer_h3.jit import spec as spec_module
from flashinfer_h3.jit.modules import JIT_FLAGS, MODULES, PREPASS_FLAGS, REGISTER_USAGE_FLAG
from flashinfer_h3.version import __version__


def _template_copy(tmp_path: Path) -> Path:
    """A private copy of templates/ that a test may edit."""
    dst = tmp_path / "templates"
    shutil.copytree(templates_dir(), dst)
    return dst


def test_templates_dir_has_every_template_and_the_headers() -> None:
    root = templates_dir()
    for templates in OP_SOURCES.values():
        for name in templates:
            assert (root / name).is_file(), f"{name} is missing from {root}"
    assert (root / "include" / "common.cuh").is_file()
    assert (root / "include" / "numerics" / "formats.cuh").is_file()
    assert (root / "include" / "binding" / "tvm_ffi_utils.h").is_file()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a", "sm_121a"])
@pytest.mark.parametrize("op", sorted(OP_SOURCES))
def test_every_module_renders(op: str, arch: str) -> None:
    from flashinfer_h3.jit.modules import MODULES

    if arch not in MODULES[op].archs:
        pytest.skip(f"module {op} is built for {', '.join(MODULES[op].archs)} only")
    spec = make_spec(KernelConfig(op, 128, arch))
    names = [name for name, _ in spec.sources]
    assert names == [t.removesuffix(".jinja") for t in OP_SOURCES[op]]
    for name, text in spec.sources:
        assert name.endswith(".cu")
        assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC" in text or "#include" in text, name
        # Jinja statements never survive rendering ("{{" can be C++ brace-init, "{%" cannot).
        assert "{%" not in text and "%}" not in text, f"{name} for {arch}"


def test_utils_render_carries_the_configuration() -> None:
    for arch in ("sm_90a", "sm_120a"):
        ((name, text),) = make_spec(KernelConfig("utils", arch=arch)).sources
        assert name == "utils.cu"
        assert f"arch={arch}" in text
        assert f"flashinfer_h3 {__version__}" in text
        assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(fill_u8" in text


def test_context_is_the_same_for_every_template_and_holds_the_flags() -> None:
    cfg = KernelConfig("nvfp4", 128, "sm_120a",
                       flags={"prepass_ctas": 64, "register_usage_level": 5})
    ctx = cfg.template_context()
    assert ctx == {
        "module": "nvfp4",
        "op": "nvfp4",
        "scale_mode": "nvfp4",
        "head_dim": 128,
        "arch": "sm_120a",
        "arch_num": 120,
        "prepass_output": "codes",
        "flags": {"prepass_ctas": 64, "register_usage_level": 5},
        "version": __version__,
    }
    # A module without a flag list takes any name, bool, int or str values alike.
    assert KernelConfig("utils", flags={"tile_k": 64, "fast": True, "tag": "x"}).template_context()[
        "flags"] == {"fast": True, "tag": "x", "tile_k": 64}
    assert KernelConfig("utils").template_context()["scale_mode"] is None
    assert KernelConfig("fp8", arch="9.0").template_context()["arch_num"] == 90
    assert KernelConfig("nvfp4_wgmma", arch="sm_90a").template_context()["prepass_output"] == "fp16"


def test_flags_reach_the_rendered_source(tmp_path: Path) -> None:
    tdir = _template_copy(tmp_path)
    (tdir / "utils.cu.jinja").write_text(
        "// tile={{ flags.tile }} mode={{ flags.get('mode', 'default') }} {{ arch_num }}\n"
    )
    spec = make_spec(KernelConfig("utils", arch="sm_120a", flags={"tile": 64}), tdir)
    assert spec.sources == (("utils.cu", "// tile=64 mode=default 120\n"),)


def test_missing_template_names_the_file_and_the_directory(tmp_path: Path) -> None:
    tdir = _template_copy(tmp_path)
    (tdir / "quantize.cu.jinja").unlink(missing_ok=True)
    with pytest.raises(TemplateNotFoundError) as info:
        make_spec(KernelConfig("fp8"), tdir)
    msg = str(info.value)
    assert "quantize.cu.jinja" in msg and str(tdir) in msg and "'fp8'" in msg
    # Both a RuntimeError (SPEC 2's toolchain errors) and a FileNotFoundError.
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, FileNotFoundError)


def test_undefined_name_is_an_error_not_an_empty_string(tmp_path: Path) -> None:
    tdir = _template_copy(tmp_path)
    (tdir / "utils.cu.jinja").write_text("int x = {{ no_such_name }};\n")
    with pytest.raises(JitError, match="no_such_name"):
        make_spec(KernelConfig("utils"), tdir)


def test_jinja_syntax_error_reports_the_line(tmp_path: Path) -> None:
    tdir = _template_copy(tmp_path)
    (tdir / "utils.cu.jinja").write_text("ok\n{% if %}\n")
    with pytest.raises(JitError, match="line 2"):
        make_spec(KernelConfig("utils"), tdir)


def test_render_templates_keeps_order_and_strips_suffix(tmp_path: Path) -> None:
    (tmp_path / "b.cu.jinja").write_text("B{{ op }}")
    (tmp_path / "a.cu.jinja").write_text("A{{ op }}")
    out = render_templates(("b.cu.jinja", "a.cu.jinja"), {"op": "z"}, tmp_path)
    assert list(out.items()) == [("b.cu", "Bz"), ("a.cu", "Az")]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"module": "bf16"}, ValueError, "unknown module 'bf16'"),
        ({"module": "nvfp4", "head_dim": 96}, ValueError, "head_dim: 96 is not supported"),
        ({"module": "nvfp4", "head_dim": True}, TypeError, "head_dim: expected int"),
        ({"module": "nvfp4", "arch": "sm_80"}, UnsupportedArchError, "sm_80"),
        ({"module": "nvfp4", "arch": "sm_100a"}, UnsupportedArchError, "sm_90a"),
        ({"module": "nvfp4", "arch": 90}, TypeError, "arch: expected str"),
        ({"module": "utils", "flags": {"not ok": 1}}, ValueError, "not an identifier"),
        ({"module": "utils", "flags": {"x": 1.5}}, TypeError, "expected bool, int or str"),
        ({"module": "utils", "flags": [("x", 1), ("x", 2)]}, ValueError, "given twice"),
        ({"module": "nvfp4", "flags": {"tile_k": 64}}, ValueError, "has no flag 'tile_k'"),
    ],
)
def test_kernel_config_rejects_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        KernelConfig(**kwargs)


@pytest.mark.parametrize("module", ["nvfp4", "fp8"])
def test_head_dim_64_renders_from_the_configuration(module: str) -> None:
    # Not offered (no backend builds it), but the templates take head_dim from the
    # configuration, so another head dim is a new configuration, not an edit.
    spec = make_spec(KernelConfig(module, 64, "sm_90a"))
    sources = dict(spec.sources)
    assert "static_assert(64 == flashinfer_h3::quantize::kHeadDim" in sources["quantize.cu"]
    if "attention_nvfp4.cu" in sources:
        assert "constexpr int64_t kHeadDim = 64;" in sources["attention_nvfp4.cu"]
    assert spec.source_key != make_spec(KernelConfig(module, 128, "sm_90a")).source_key


def test_test_only_modules_are_not_production_modules() -> None:
    from flashinfer_h3.jit import production_configs
    from flashinfer_h3.jit.modules import MODULES, production_modules

    probe = MODULES["nvfp4_mma_probe"]
    assert probe.test_only and probe not in production_modules()
    assert "mma_nvfp4_probe" not in "".join(
        text for _, text in make_spec(KernelConfig("nvfp4", arch="sm_90a")).sources
    )
    assert "nvfp4_mma_probe" not in {c.module for c in production_configs(["sm_90a", "sm_120a"])}


def test_a_module_is_built_only_for_its_archs(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashinfer_h3.jit import production_configs
    from flashinfer_h3.jit.modules import MODULES, ModuleDef

    hopper_only = ModuleDef("hopper_only_for_test", ("utils.cu.jinja",), None, archs=("sm_90a",))
    monkeypatch.setitem(MODULES, hopper_only.name, hopper_only)
    with pytest.raises(ValueError, match="built for sm_90a only, not sm_120a"):
        KernelConfig(hopper_only.name, arch="sm_120a")
    names = [c.name for c in production_configs(["sm_90a", "sm_120a"])]
    assert "hopper_only_for_test_hd128_sm90a" in names
    assert not any(n.startswith("hopper_only_for_test_hd128_sm120a") for n in names)


@pytest.mark.parametrize(
    ("text", "arch"),
    [
        ("sm_90a", "sm_90a"),
        ("90a", "sm_90a"),
        ("9.0", "sm_90a"),
        ("9.0a", "sm_90a"),
        ("compute_120a", "sm_120a"),
        ("12.0", "sm_120a"),
        ("SM_121A", "sm_121a"),
        ("12.1", "sm_121a"),
    ],
)
def test_arch_names_are_normalized(text: str, arch: str) -> None:
    cfg = KernelConfig("utils", arch=text)
    assert cfg.arch == arch
    assert cfg == KernelConfig("utils", arch=arch)  # equal configs hash equal
    assert hash(cfg) == hash(KernelConfig("utils", arch=arch))


def test_flags_order_does_not_matter() -> None:
    a = KernelConfig("utils", flags={"a": 1, "b": 2})
    b = KernelConfig("utils", flags=[("b", 2), ("a", 1)])
    assert a == b and a.flags == (("a", 1), ("b", 2))


@pytest.mark.parametrize(
    ("module", "flags", "expected"),
    [
        (
            "fp8_wgmma",
            {},
            ["/*poly_exp2_every=*/64,", "/*ping_pong=*/true,", "/*stages=*/fh3::sm90::kFp8Stages,",
             "/*softmax=*/true,", "/*o_update=*/true,",
             "/*wait_sleep_ns=*/fh3::sm90::kProducerWaitSleepNs,", "/*dynamic_schedule=*/false,",
             "/*tile_keys=*/256,", "/*kv_copies=*/true,", "/*cluster_ctas=*/1,",
             "/*q_in_kernel=*/0,", "/*background_traffic=*/0,", "/*interleaved_pack=*/true>"],
        ),
        (
            "fp8_wgmma",
            {"poly_exp2_every": 8, "ping_pong": False, "stages": 3, "softmax": False,
             "o_update": False, "wait_sleep_ns": 0, "dynamic_schedule": True, "tile_keys": 128,
             "kv_copies": False, "cluster_ctas": 2, "q_in_kernel": 1},
            ["/*poly_exp2_every=*/8,", "/*ping_pong=*/false,", "/*stages=*/3,",
             "/*softmax=*/false,", "/*o_update=*/false,", "/*wait_sleep_ns=*/0,",
             "/*dynamic_schedule=*/true,", "/*tile_keys=*/128,", "/*kv_copies=*/false,",
             "/*cluster_ctas=*/2,", "/*q_in_kernel=*/1,", "/*background_traffic=*/0,",
             "/*interleaved_pack=*/false>"],
        ),
        (
            "fp8_wgmma",
            {"background_traffic": 2},
            ["/*background_traffic=*/2,"],
        ),
        (
            "fp8_wgmma",
            {"interleaved_pack": False},
            ["/*background_traffic=*/0,", "/*interleaved_pack=*/false>"],
        ),
        (
            "nvfp4_wgmma",
            {},
            ["kVariant = fh3::sm90::kNvfp4Production;", "kKStages = fh3::sm90::kNvfp4KStages;",
             "kVStages = fh3::sm90::kNvfp4VStages;",
             "kWaitSleepNs = fh3::sm90::kProducerWaitSleepNs;"],
        ),
        (
            "nvfp4_wgmma",
            {"quantize_p": False, "ping_pong": False, "k_stages": 2, "v_stages": 3,
             "wait_sleep_ns": 0, "fold_p_scale": False, "dynamic_schedule": False,
             "kv_copies": False},
            ["& ~fh3::sm90::kQuantizeP", "& ~fh3::sm90::kPingPongOrder", "kKStages = 2;",
             "kVStages = 3;", "kWaitSleepNs = 0;", "& ~fh3::sm90::kFoldPScale",
             "& ~fh3::sm90::kDynamicOrder", "& ~fh3::sm90::kCopyKvTiles;"],
        ),
        (
            "nvfp4_wgmma",
            {"background_traffic": 1},
            ["| fh3::sm90::kBackgroundTraffic;"],
        ),
        (
            "nvfp4_wgmma",
            {"background_traffic": 2},
            ["| fh3::sm90::kBackgroundTrafficSkipped;"],
        ),
        (
            "nvfp4_wgmma",
            {"delta_mma_sync": True},
            ["& ~(fh3::sm90::kDeltaOnWgmma | fh3::sm90::kDeltaWgmmaSmemA | "
             "fh3::sm90::kWideConsumers);"],
        ),
        (
            "nvfp4_wgmma",
            {"delta_wgmma_regs": True},
            ["& ~(fh3::sm90::kDeltaWgmmaSmemA | fh3::sm90::kWideConsumers);"],
        ),
        (
            "nvfp4_wgmma",
            {"wide_consumers": False},
            ["& ~fh3::sm90::kWideConsumers;"],
        ),
        (
            "nvfp4_wgmma",
            {},
            ["kPolyExp2Every = 0;"],
        ),
        (
            "nvfp4_wgmma",
            {"poly_exp2_every": 32},
            ["kPolyExp2Every = 32;"],
        ),
    ],
)
def test_benchmark_flags_reach_the_hopper_bindings(
    module: str, flags: dict, expected: list[str]
) -> None:
    # The benchmark-only builds (benchmarks/bench_wgmma_variants.py) are KernelConfig flags; a
    # template reading a name outside `flags` would silently render its default instead.
    spec = make_spec(KernelConfig(module, arch="sm_90a", flags=flags))
    text = "\n".join(source for _, source in spec.sources)
    for line in expected:
        assert line in text, f"{module} {flags}: {line!r} not in the rendered binding"


@pytest.mark.parametrize("module", ["fp8_wgmma", "nvfp4_wgmma", "fp8", "nvfp4"])
@pytest.mark.parametrize(("flags", "cap"), [({}, 0), ({"prepass_ctas": 16}, 16)])
def test_prepass_cta_cap_reaches_the_quantize_binding(module: str, flags: dict, cap: int) -> None:
    # benchmarks/bench_prepass_sms.py: the pre-pass's tile launches on at most `cap` CTAs; the
    # production build (no flag) keeps every CTA that fits (0) and so its launcher's code.
    spec = make_spec(KernelConfig(module, arch="sm_90a", flags=flags))
    text = "\n".join(source for _, source in spec.sources)
    assert f"constexpr int kPrepassMaxCtas = {cap};" in text
    assert "qz::launch_quantize<kQuantizeStages, kPrepassMaxCtas, kPrepassWithQ>(" in text


@pytest.mark.parametrize(("flags", "with_q", "mode"),
                         [({}, "true", 0), ({"q_in_kernel": 1}, "false", 1),
                          ({"q_in_kernel": 2}, "false", 2)])
def test_q_in_kernel_reaches_both_fp8_wgmma_bindings(flags: dict, with_q: str, mode: int) -> None:
    # The q_in_kernel build: the kernel quantises Q (Fp8Options' q_in_kernel) and the module's
    # pre-pass, rendered with the same flags, skips its Q items (launch_quantize's kWithQ).
    spec = make_spec(KernelConfig("fp8_wgmma", arch="sm_90a", flags=flags))
    text = "\n".join(source for _, source in spec.sources)
    assert f"constexpr bool kPrepassWithQ = {with_q};" in text
    assert f"/*q_in_kernel=*/{mode}," in text


def _flags_read_by(templates: tuple[str, ...]) -> set[str]:
    """The flag names a module's templates read, from their Jinja syntax trees: ``flags.get("x",
    ...)``, ``flags["x"]``, ``"x" in flags`` / ``not in``. Any other use of ``flags`` (an attribute,
    ``.items()``, an alias, a computed key) fails the test: its names could not be listed."""
    import jinja2
    from jinja2 import nodes

    names: set[str] = set()
    env = jinja2.Environment()
    for template in templates:
        tree = env.parse((templates_dir() / template).read_text())
        understood: set[int] = set()
        for node in tree.find_all((nodes.Call, nodes.Getitem, nodes.Compare)):
            if (isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr)
                    and isinstance(node.node.node, nodes.Name) and node.node.node.name == "flags"
                    and node.node.attr == "get" and node.args
                    and isinstance(node.args[0], nodes.Const)):
                names.add(node.args[0].value)
                understood.add(id(node.node.node))
            elif (isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name)
                  and node.node.name == "flags" and isinstance(node.arg, nodes.Const)):
                names.add(node.arg.value)
                understood.add(id(node.node))
            elif (isinstance(node, nodes.Compare) and isinstance(node.expr, nodes.Const)
                  and len(node.ops) == 1 and node.ops[0].op in ("in", "notin")
                  and isinstance(node.ops[0].expr, nodes.Name)
                  and node.ops[0].expr.name == "flags"):
                names.add(node.expr.value)
                understood.add(id(node.ops[0].expr))
        other = [n.lineno for n in tree.find_all(nodes.Name)
                 if n.name == "flags" and id(n) not in understood]
        assert not other, f"{template}: flags used in a way the list cannot follow (lines {other})"
    return names


@pytest.mark.parametrize("module", [n for n, m in MODULES.items() if m.flags is not None])
def test_declared_flags_are_the_ones_the_templates_read(module: str) -> None:
    # jit/modules.py lists the flags a module takes; a template flag missing there could not be
    # built, a listed one no template reads would build production under another name.
    # q_in_kernel is read by the shared pre-pass template to refuse it outside fp8_wgmma.
    definition = MODULES[module]
    read = _flags_read_by(definition.templates) | set(JIT_FLAGS)
    if module != "fp8_wgmma":
        read.discard("q_in_kernel")
    assert definition.flags is not None and set(definition.flags) == read
    assert REGISTER_USAGE_FLAG in JIT_FLAGS
    assert spec_module.REGISTER_USAGE_FLAG == REGISTER_USAGE_FLAG


def test_every_attention_module_declares_its_flags() -> None:
    # The mma.sync modules take only the pre-pass's and the JIT's flags; utils and the test-only
    # probe module keep taking any name (the render tests use that).
    declared = {n for n, m in MODULES.items() if m.flags is not None}
    assert declared >= {"nvfp4", "fp8", "fp8_wgmma", "nvfp4_wgmma"}
    assert set(MODULES["nvfp4"].flags or ()) == set(MODULES["fp8"].flags or ()) == set(
        PREPASS_FLAGS + JIT_FLAGS)


@pytest.mark.parametrize(("module", "flag"), [
    ("nvfp4_wgmma", "delta_wgmma"), ("nvfp4_wgmma", "delta_ffma"), ("nvfp4_wgmma", "q_in_kernel"),
    ("fp8_wgmma", "delta"), ("fp8_wgmma", "tile_key"),
])
def test_unknown_flags_of_a_hopper_module_are_refused(module: str, flag: str) -> None:
    # A misspelt or removed benchmark flag: refused by name before anything renders.
    with pytest.raises(ValueError, match=rf"module '{module}' has no flag '{flag}'; expected"):
        KernelConfig(module, arch="sm_90a", flags={flag: 1})
    # Modules without a declared list keep taking any flag (rendered as the templates see it).
    assert dict(KernelConfig("utils", flags={flag: 1}).flags) == {flag: 1}

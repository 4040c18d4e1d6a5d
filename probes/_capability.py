"""What each NVIDIA architecture runs in hardware, what each FP8 recipe needs, and datasheet
peak TFLOP/s per SKU: pure data.

``capability_for`` does not use ``torch.cuda.is_bf16_supported()``, which also says yes where
bf16 is emulated (a V100). Peaks are dense (no 2:4 sparsity), quoted from the NVIDIA document
each row names (dense is half a sparse-only figure); docs/capabilities.md lists them."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from probes._errors import MpadviseError
from probes._profile import HardwareProfile


@dataclass(frozen=True)
class ArchCapability:
    """The number formats one GPU architecture runs on tensor cores.

    ``mxfp8``/``nvfp4`` are what the hardware has (Blackwell); whether a library's recipe runs
    is in ``FP8_RECIPE_RULES``. ``fp8_min_cuda``: the oldest CUDA whose cuBLASLt runs FP8
    matmuls on this architecture, where one applies."""

    arch: str
    compute_capability: tuple[int, int]
    fp16_tensor_cores: bool = True
    tf32: bool = True
    bf16: bool = True
    fp8: bool = False
    mxfp8: bool = False
    nvfp4: bool = False
    fp8_min_cuda: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """``"Hopper (9.0)"``."""
        return f"{self.arch} ({_dotted(self.compute_capability)})"


def capability_for(compute_capability: tuple[int, int]) -> ArchCapability:
    """Which formats a GPU of this compute capability runs on tensor cores; docs/capabilities.md
    has the table. Minors not in NVIDIA's tables (say 8.8) get their major's answer; majors newer
    than Blackwell are assumed to keep Blackwell's formats, as each generation so far has.

    Raises:
        MpadviseError: ``compute_capability`` is not a pair of non-negative integers.
    """
    major, minor = cc = _validated(compute_capability)
    if major < 7:  # Pascal and older: no tensor cores; bf16 exists only as emulation
        return ArchCapability("pre-Volta", cc, fp16_tensor_cores=False, tf32=False, bf16=False)
    if major == 7:  # 7.0 V100, 7.2 Xavier (both Volta); 7.5 Turing
        return ArchCapability("Turing" if minor >= 5 else "Volta", cc, tf32=False, bf16=False)
    if major == 8 and minor >= 9:
        # Ada: cuBLASLt runs FP8 matmuls from CUDA 12.1 (TE's check_fp8_support refuses older).
        return ArchCapability("Ada", cc, fp8=True, fp8_min_cuda=(12, 1))
    if major == 8:  # 8.0 A100, 8.6 GA10x (A10, RTX 30xx), 8.7 Orin
        return ArchCapability("Ampere", cc)
    if major == 9:
        return ArchCapability("Hopper", cc, fp8=True)
    # 10.x B200/GB200, 11.x Thor, 12.x RTX 50xx / RTX PRO: hardware block scaling.
    arch = "Blackwell" if major <= 12 else "post-Blackwell"
    return ArchCapability(arch, cc, fp8=True, mxfp8=True, nvfp4=True)


def _validated(compute_capability: object) -> tuple[int, int]:
    if not isinstance(compute_capability, (tuple, list)) or len(compute_capability) != 2 or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in compute_capability
    ):
        raise MpadviseError("compute_capability must be a (major, minor) pair of non-negative "
                            f"integers, got {compute_capability!r}")
    return (compute_capability[0], compute_capability[1])


def release(version: str | None) -> tuple[int, int] | None:
    """``"2.3.0+cu12"`` -> ``(2, 3)``; ``None`` when it has no release line."""
    match = re.match(r"(\d+)\.(\d+)", version.strip()) if isinstance(version, str) else None
    return (int(match[1]), int(match[2])) if match else None


def _dotted(pair: tuple[int, int]) -> str:
    return f"{pair[0]}.{pair[1]}"


# Code built for an integrated GPU (Jetson TX1 5.3, TX2 6.2, Xavier 7.2, Orin 8.7) runs only
# there, and those GPUs run no code built for another capability; code for 10.1 (Thor, which
# CUDA 13 renumbered 11.0) runs on both numbers. Read from torch.cuda's DEVICE_REQUIREMENT table.
_RUNS_ONLY_ON = {53: {53}, 62: {62}, 72: {72}, 87: {87}, 101: {101, 110}}
_TAKES_ONLY_ITS_OWN = {53, 62, 72, 87, 101}


def torch_build_covers(compute_capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool | None:
    """Whether a torch build compiled for ``arch_list`` (``get_arch_list()``) has kernels for
    this compute capability; ``None`` when the list is empty (not recorded, or no CUDA).

    Code built for ``sm_XY`` runs on X.Y and later minors of major X (torch's own
    ``torch.cuda._check_capability``): a cu126 build, up to ``sm_90``, has nothing for Blackwell."""
    if not arch_list:
        return None
    major, minor = _validated(compute_capability)
    device = 10 * major + minor
    # "sm_90a" -> 90, "compute_120f" -> 120; an entry of another form is skipped.
    numbers = (str(entry).partition("_")[2].rstrip(string.ascii_lowercase) for entry in arch_list)
    for code in (int(number) for number in numbers if number.isdigit()):
        if code in _RUNS_ONLY_ON:
            if device in _RUNS_ONLY_ON[code]:
                return True
        elif device not in _TAKES_ONLY_ITS_OWN and code // 10 == major and minor >= code % 10:
            return True
    return False


@dataclass(frozen=True)
class Fp8RecipeRule:
    """What one FP8 recipe of one library needs, for a range of that library's versions.

    ``below_cc``/``below_library`` are exclusive upper bounds (``None``: none); ``min_cuda`` is
    the CUDA torch was built with, beyond the architecture's floor; ``min_library`` of a recipe's
    first rule is the first version that has it. A Linear runs in FP8 only with its features a
    multiple of ``dim_multiple``, its tokens (all dimensions but the last) of ``token_multiple``."""

    library: str
    recipe: str
    min_cc: tuple[int, int] = (8, 9)
    below_cc: tuple[int, int] | None = None
    min_cuda: tuple[int, int] | None = None
    min_library: tuple[int, int] | None = None
    below_library: tuple[int, int] | None = None
    dim_multiple: int = 16
    token_multiple: int = 1

    def covers_version(self, version: tuple[int, int]) -> bool:
        below = self.below_library is None or version < self.below_library
        return below and (self.min_library is None or version >= self.min_library)

    def runs_on(self, compute_capability: tuple[int, int]) -> bool:
        cc = tuple(compute_capability)
        return cc >= self.min_cc and (self.below_cc is None or cc < self.below_cc)

    def cc_range(self) -> str:
        """``"10.x or 11.x"``, ``"9.0 or newer"``: the compute capabilities it runs on."""
        if self.below_cc is None:
            return f"{_dotted(self.min_cc)} or newer"
        if self.min_cc[1] == 0 and self.below_cc[1] == 0:
            return " or ".join(f"{major}.x" for major in range(self.min_cc[0], self.below_cc[0]))
        return f"{_dotted(self.min_cc)} up to, not including, {_dotted(self.below_cc)}"


# Read from each library's source; docs/capabilities.md cites the lines and says why.
FP8_RECIPE_RULES: tuple[Fp8RecipeRule, ...] = (
    # Transformer Engine: check_recipe_support decides the device, assert_dim_for_fp8_exec shapes.
    Fp8RecipeRule("transformer_engine", "delayed", token_multiple=8),
    Fp8RecipeRule("transformer_engine", "current", min_library=(2, 2), token_multiple=8),
    # MXFP8 scales blocks of 32 along both dimensions; TE refuses it on 12.0 and newer (RTX 5090).
    Fp8RecipeRule("transformer_engine", "mxfp8", min_cc=(10, 0), below_cc=(12, 0),
                  min_library=(2, 0), dim_multiple=32, token_multiple=32),
    # check_fp8_block_scaling_support: CUDA 12.9 always; Hopper alone until 2.8, 9.0 and newer from 2.9.
    Fp8RecipeRule("transformer_engine", "block", min_cc=(9, 0), below_cc=(10, 0), min_cuda=(12, 9),
                  min_library=(2, 3), below_library=(2, 9), token_multiple=8),
    Fp8RecipeRule("transformer_engine", "block", min_cc=(9, 0), min_cuda=(12, 9), min_library=(2, 9), token_multiple=8),
    # torchao: torch._scaled_mm wants inner dimensions (the weight gradient's is the token count,
    # computed in high precision by rowwise_with_gw_hp) a multiple of 16. It has no MXFP8 recipe.
    Fp8RecipeRule("torchao", "tensorwise", token_multiple=16),
    Fp8RecipeRule("torchao", "rowwise", token_multiple=16),
    Fp8RecipeRule("torchao", "rowwise_with_gw_hp"),
)


def _recipe_rules(library: str, recipe: str) -> list[Fp8RecipeRule]:
    rules = [rule for rule in FP8_RECIPE_RULES if rule.library == library and rule.recipe == recipe]
    if not rules:
        known = ", ".join(sorted({f"{r.library} {r.recipe}" for r in FP8_RECIPE_RULES}))
        raise MpadviseError(f"no FP8 recipe rule for {library} recipe {recipe!r}; known: {known}")
    return rules


def fp8_recipe_rule(library: str, recipe: str, library_version: str | None = None) -> Fp8RecipeRule:
    """The rule for a library's recipe at an installed version; the newest rule for ``None``, an
    unreadable version, or one older than the recipe.

    Raises:
        MpadviseError: no rule for this library and recipe.
    """
    rules, version = _recipe_rules(library, recipe), release(library_version)
    covering = [rule for rule in rules if version is not None and rule.covers_version(version)]
    return covering[0] if covering else rules[-1]


def fp8_recipe_since(library: str, recipe: str) -> tuple[int, int] | None:
    """The first version of ``library`` that has ``recipe``; ``None`` when every version has it."""
    return _recipe_rules(library, recipe)[0].min_library


def fp8_recipe_unmet(library: str, recipe: str, *, compute_capability: tuple[int, int], cuda_runtime: str | None,
                     library_version: str | None, library_display: str | None = None) -> str | None:
    """What an FP8 recipe needs that this device, CUDA and library version lack, as one clause
    (``"needs CUDA 12.9 or newer (torch was built with CUDA 12.4)"``); ``None`` when it runs.

    A ``None`` (or unreadable) ``cuda_runtime`` or ``library_version`` skips that check."""
    name = library_display or library
    rules, version = _recipe_rules(library, recipe), release(library_version)
    first = rules[0].min_library
    if version is not None and first is not None and version < first:
        return f"needs {name} {_dotted(first)} or newer (this is {library_version})"
    rule = fp8_recipe_rule(library, recipe, library_version)
    cc = _validated(compute_capability)
    if not rule.runs_on(cc):
        clause = f"needs compute capability {rule.cc_range()}"
        if rule.below_library is not None:
            clause += f" with {name} {library_version}"
        clause += f" (this is {_dotted(cc)})"
        later = [r for r in rules if r.min_library is not None and r.min_library > (version or (0, 0)) and r.runs_on(cc)]
        if later:
            clause += f"; {name} {_dotted(later[0].min_library)} or newer runs it here"
        return clause
    cuda = release(cuda_runtime)
    if rule.min_cuda is not None and cuda is not None and cuda < rule.min_cuda:
        return f"needs CUDA {_dotted(rule.min_cuda)} or newer (torch was built with CUDA {cuda_runtime})"
    return None


@dataclass(frozen=True)
class SkuPeak:
    """Datasheet dense peak TFLOP/s of one GPU SKU; ``pattern`` is searched case-insensitively
    in the device name, and a dtype absent from ``tflops`` has no hardware path."""

    sku: str
    pattern: str
    tflops: tuple[tuple[str, float], ...]
    source: str


# Ordered: the first match wins, so more specific names come before their prefixes
# (H100 PCIe before H100, A100 before A10). Variants whose figures we could not check
# (H100 NVL, H200 NVL, L40 without S, A10G, RTX 3090 Ti, laptop parts) deliberately match
# nothing: no number is better than a wrong one.
SKU_PEAKS: tuple[SkuPeak, ...] = (
    # P100: fp16 is CUDA-core half2 (2x fp32).
    SkuPeak("P100 SXM2", r"P100.*SXM2", (("fp32", 10.6), ("fp16", 21.2)), "NVIDIA Tesla P100 datasheet"),
    SkuPeak("P100 PCIe", r"P100.*PCIE", (("fp32", 9.3), ("fp16", 18.7)), "NVIDIA Tesla P100 datasheet"),
    # V100 and T4: "Tensor Performance" / "Mixed Precision" is fp16 in, fp32 accumulate.
    SkuPeak("V100S PCIe", r"V100S", (("fp32", 16.4), ("fp16", 130.0)), "NVIDIA V100 Tensor Core GPU datasheet (V100S)"),
    SkuPeak("V100 SXM2", r"V100\b.*SXM", (("fp32", 15.7), ("fp16", 125.0)), "NVIDIA Tesla V100 GPU Accelerator datasheet"),
    SkuPeak("V100 PCIe", r"V100\b.*PCIE", (("fp32", 14.0), ("fp16", 112.0)), "NVIDIA Tesla V100 GPU Accelerator datasheet"),
    SkuPeak("T4", r"\bT4\b", (("fp32", 8.1), ("fp16", 65.0)), "NVIDIA T4 Tensor Core GPU datasheet"),
    # A100: same peaks for 40GB/80GB, SXM4 and PCIe; the datasheet's starred figures are sparse.
    SkuPeak("A100", r"\bA100\b", (("fp32", 19.5), ("tf32", 156.0), ("fp16", 312.0), ("bf16", 312.0)),
            "NVIDIA A100 Tensor Core GPU datasheet"),
    SkuPeak("A10", r"\bA10\b(?!\d|G)", (("fp32", 31.2), ("tf32", 62.5), ("fp16", 125.0), ("bf16", 125.0)),
            "NVIDIA A10 Tensor Core GPU datasheet"),
    # GeForce runs fp16/bf16 with fp32 accumulate (what PyTorch uses) at half the fp16-accumulate
    # rate; fp8 with fp32 accumulate is what torch._scaled_mm uses, and the least certain figure.
    SkuPeak("RTX 3090", r"RTX 3090(?!\s*Ti)(?!.*Laptop)",
            (("fp32", 35.6), ("tf32", 35.6), ("fp16", 71.0), ("bf16", 71.0)),
            "NVIDIA Ampere GA102 GPU Architecture whitepaper"),
    SkuPeak("RTX 4090", r"RTX 4090(?!\s*D\b)(?!.*Laptop)",
            (("fp32", 82.6), ("tf32", 82.6), ("fp16", 165.2), ("bf16", 165.2), ("fp8", 330.3)),
            "NVIDIA Ada GPU Architecture whitepaper"),
    # L4 and from here on, where only sparse figures are given (L4: 120 / 242 / 485), dense is half.
    SkuPeak("L4", r"\bL4\b", (("fp32", 30.3), ("tf32", 60.0), ("fp16", 121.0), ("bf16", 121.0), ("fp8", 242.5)),
            "NVIDIA L4 Tensor Core GPU datasheet"),
    SkuPeak("L40S", r"\bL40S\b",
            (("fp32", 91.6), ("tf32", 183.0), ("fp16", 362.05), ("bf16", 362.05), ("fp8", 733.0)),
            "NVIDIA L40S GPU datasheet"),
    # The PCIe part is named "NVIDIA H100 PCIe", the SXM part "NVIDIA H100 80GB HBM3"; the H200 is
    # the H100 SXM die with more HBM, same compute peaks.
    SkuPeak("H100 PCIe", r"H100\b.*PCIE",
            (("fp32", 51.2), ("tf32", 378.0), ("fp16", 756.0), ("bf16", 756.0), ("fp8", 1513.0)),
            "NVIDIA H100 Tensor Core GPU Architecture whitepaper"),
    SkuPeak("H100 SXM", r"H100\b.*\b(SXM|HBM3)\b",
            (("fp32", 66.9), ("tf32", 494.7), ("fp16", 989.4), ("bf16", 989.4), ("fp8", 1978.9)),
            "NVIDIA H100 Tensor Core GPU Architecture whitepaper"),
    SkuPeak("H200 SXM", r"\bH200\b(?!.*NVL)",
            (("fp32", 66.9), ("tf32", 494.7), ("fp16", 989.4), ("bf16", 989.4), ("fp8", 1978.9)),
            "NVIDIA H200 Tensor Core GPU datasheet"),
    # Per GPU; FP32 as listed (GB200 at up to 1,200 W).
    SkuPeak("B200", r"\bB200\b", (("fp32", 75.0), ("tf32", 1100.0), ("fp16", 2250.0), ("bf16", 2250.0),
                                  ("fp8", 4500.0), ("fp4", 9000.0)), "NVIDIA HGX B200 specifications"),
    SkuPeak("GB200", r"\bGB200\b", (("fp32", 80.0), ("tf32", 1250.0), ("fp16", 2500.0), ("bf16", 2500.0),
                                    ("fp8", 5000.0), ("fp4", 10000.0)), "NVIDIA GB200 NVL72 specifications"),
)

def match_sku(device_name: str) -> SkuPeak | None:
    """The datasheet row for a CUDA device name (``"NVIDIA A100-SXM4-80GB"``), or ``None``."""
    matches = (peak for peak in SKU_PEAKS if re.search(peak.pattern, device_name, re.IGNORECASE))
    return next(matches, None)


def peak_tflops(profile: HardwareProfile) -> dict[str, float]:
    """Datasheet dense peak TFLOP/s per dtype for this device (a fresh dict); ``{}`` when unknown.

    CPUs have no table: their peaks depend on clocks, cores and vector width that vary by part."""
    peak = match_sku(profile.name) if profile.is_cuda else None
    return dict(peak.tflops) if peak is not None else {}

"""Per-vendor defaults: GPU resource, images, environment, node affinity, tolerations.

Precedence (as OME's AcceleratorClass): these vendor defaults, then the pool's own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rljob.api.spec import EnvVar, Toleration

Vendor = Literal["nvidia", "amd"]

# The SGLang release of the default inference images: the newest release. The previous pin,
# v0.5.5.post3, keeps working (set spec.rollout.pools[].image); the client detects each worker's
# release (docs/sglang_releases.md), and tests/unit/test_sglang_contract.py checks both.
SGLANG_VERSION = "v0.5.23"
SGLANG_PREVIOUS_VERSION = "v0.5.5.post3"
# Upstream ROCm tag suffix for MI300-series GPUs (ROCm 7.2 images since v0.5.10; v0.5.5.post3 had rocm700).
SGLANG_ROCM_SUFFIX = "rocm720-mi30x"
# sglang-router release the router image (images/router.Dockerfile) installs.
SGLANG_ROUTER_VERSION = "0.3.2"
RLJOB_VERSION = "0.1.0"
# Runtime/trainer images built from images/ (tags follow the rljob distribution version): one per
# trainer vendor, so a GPU trainer never gets a CPU-only PyTorch.
RUNTIME_IMAGE = f"rljob/runtime:{RLJOB_VERSION}"
TRAINER_IMAGES: dict[str, str] = {
    "cpu": RUNTIME_IMAGE,
    "nvidia": f"rljob/runtime:{RLJOB_VERSION}-cuda",
    "amd": f"rljob/runtime:{RLJOB_VERSION}-rocm",
}
# The router is CPU-only HTTP: a small image with the sglang-router package, not the CUDA SGLang image.
ROUTER_IMAGE = f"rljob/router:{SGLANG_ROUTER_VERSION}"
# Numeric users of the images (runAsNonRoot can only verify numeric ids). The upstream SGLang images
# run as root; the pods run them as the user of images/sglang-*.Dockerfile instead.
RUNTIME_UID = 1000
SGLANG_UID = 10001
ROUTER_UID = 65532
# What a `cpu` inference pool runs: rljob's SGLang-protocol server from the runtime image.
CPU_SERVER_COMMAND = ["python", "-m", "rljob.runtime.engines.server"]


@dataclass(frozen=True)
class VendorProfile:
    """Everything that differs between NVIDIA/CUDA and AMD/ROCm pods."""

    resource_name: str
    sglang_image: str
    # A label GPU discovery puts on every node of this vendor (GFD / ROCm node labeller).
    node_label: str
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def env_vars(self) -> list[EnvVar]:
        """Default environment variables as spec models."""
        return [EnvVar(name=k, value=v) for k, v in self.env]

    def toleration(self) -> Toleration:
        """Tolerate the conventional `<resource>:NoSchedule` taint of GPU nodes."""
        return Toleration(key=self.resource_name, operator="Exists", effect="NoSchedule")


PROFILES: dict[str, VendorProfile] = {
    "nvidia": VendorProfile(
        resource_name="nvidia.com/gpu",
        sglang_image=f"lmsysorg/sglang:{SGLANG_VERSION}",
        node_label="nvidia.com/gpu.product",
        env=(("NVIDIA_DRIVER_CAPABILITIES", "compute,utility"), ("RLJOB_GPU_VENDOR", "nvidia")),
    ),
    "amd": VendorProfile(
        resource_name="amd.com/gpu",
        sglang_image=f"lmsysorg/sglang:{SGLANG_VERSION}-{SGLANG_ROCM_SUFFIX}",
        node_label="amd.com/gpu.product-name",
        # Recommended for SGLang on MI300-class GPUs (avoids scratch reclaim stalls).
        env=(("HSA_NO_SCRATCH_RECLAIM", "1"), ("RLJOB_GPU_VENDOR", "amd")),
    ),
}


def vendor_affinity(vendor: Vendor) -> dict[str, Any]:
    """Required node affinity: only nodes labelled as this vendor's GPU nodes."""
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": PROFILES[vendor].node_label, "operator": "Exists"}]}
                ]
            }
        }
    }


def tolerations(vendor: Vendor, extra: list[Toleration]) -> list[dict[str, Any]]:
    """The vendor's GPU toleration plus the user's, without duplicates."""
    result: list[dict[str, Any]] = []
    for t in [PROFILES[vendor].toleration(), *extra]:
        wire = t.to_wire()
        if wire not in result:
            result.append(wire)
    return result

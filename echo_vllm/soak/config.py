"""The soak's settings (one frozen dataclass), its user error, and where the default models come from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from echo_vllm.errors import ConfigError
from echo_vllm.testbed.paths import testbed_dir

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
CHECKOUT_TESTBED = REPO_ROOT / "tests" / "assets" / "testbed"
# Resident memory of the server's process tree (API server + EngineCore + its worker) between the end of the
# warm-up burst and the end of the soak. Measured on the CPU testbed (docs/soak.md): a fresh server's worker heap
# grows for its first ~2000 requests and then levels off (+451 MiB over 4000 requests, +24 MiB of it in the second
# half; the no-spec server shows the same curve, about half as high). So two bounds: total growth < 640 MiB, and
# growth over the second half of a soak of >= 120 s < 64 MiB, which a leak proportional to requests breaks.
DEFAULT_MEMORY_BOUND_MIB = 640
DEFAULT_PLATEAU_BOUND_MIB = 64


class SoakError(ConfigError):
    """A bad soak option or missing model: printed as one line."""


@dataclass(frozen=True)
class SoakConfig:
    model: Path
    head: Path
    out_dir: Path
    requests: int = 500
    concurrency: int = 32
    duration_s: float = 300.0  # the soak traffic stops starting requests after this
    json_path: Path | None = None
    k_max: int = 16  # binding at concurrency 32 with depth 4: 32 requests could draft 128 tokens
    depth: int = 4
    warmup_steps: int = 32
    max_num_seqs: int = 32
    max_model_len: int = 1024
    seed: int = 0
    warmup_requests: int = 200
    memory_bound_mib: int = DEFAULT_MEMORY_BOUND_MIB
    plateau_bound_mib: int = DEFAULT_PLATEAU_BOUND_MIB
    settle_s: float = 20.0
    ready_timeout_s: float = 300.0
    request_timeout_s: float = 300.0
    log_interval_s: float = 5.0
    per_request_seed: bool = False

    def validate(self) -> SoakConfig:
        for name in ("requests", "concurrency", "max_num_seqs", "depth"):
            if getattr(self, name) < 1:
                raise SoakError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.duration_s <= 0:
            raise SoakError(f"--duration-s must be > 0, got {self.duration_s}")
        if self.k_max < 0 or self.warmup_requests < 0 or min(self.memory_bound_mib, self.plateau_bound_mib) <= 0:
            raise SoakError(
                "--k-max and --warmup-requests must be >= 0, --memory-bound-mib and --plateau-bound-mib > 0"
            )
        for label, path in (("--model", self.model), ("--head", self.head)):
            if not (path / "config.json").is_file():
                raise SoakError(f"{label} {path}: no config.json there (`make testbed` installs the testbed)")
        return self

    def speculative_config(self) -> dict[str, Any]:
        return {
            "method": "echo",
            "model": str(self.head),
            "num_speculative_tokens": self.depth,
            "echo": {"k_max": self.k_max, "warmup_steps": self.warmup_steps},
        }

    def write_speculative_config(self) -> Path:
        path = self.out_dir / "echo.json"
        path.write_text(json.dumps(self.speculative_config(), indent=2) + "\n")
        return path

    def as_dict(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def default_models(model: str | None, head: str | None) -> tuple[Path, Path, str | None]:
    """(target, head, note): the installed testbed, else this checkout's tests/assets/testbed (with a note)."""
    root = testbed_dir(None)
    note = None
    if not (root / "target" / "config.json").is_file():
        if (CHECKOUT_TESTBED / "target" / "config.json").is_file():
            note = (
                f"no installed testbed at {root}; using this checkout's {CHECKOUT_TESTBED} (`make testbed` installs it)"
            )
            root = CHECKOUT_TESTBED
        elif model is None or head is None:
            raise SoakError(f"testbed missing at {root}: run `make testbed` (or pass --model and --head)")
    target = Path(model).expanduser() if model else root / "target"
    drafter = Path(head).expanduser() if head else root / "eagle3"
    return target.resolve(), drafter.resolve(), None if (model and head) else note

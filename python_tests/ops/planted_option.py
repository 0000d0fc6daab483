"""Run by test_loss_option_carrier.py in a fresh process: plants one more kernel option in LossOptions (the
one edit an author makes in Python) and checks that every derived place has it. Prints "planted option: ok"."""

import importlib.util, inspect, math, sys
from pathlib import Path

root = Path(sys.argv[1])
source = (root / "flashreinforce" / "objective.py").read_text()
anchor = "    eps_clip: tuple[float, float] = _option("
assert anchor in source
field = ('    planted_cap: float = _option(math.inf, "actor.planted_cap", "float", "a planted option", '
         'mode="flash_reinforce", kernel=True)\n')
import flashreinforce  # noqa: F401  (the package first; its objective module is replaced before any use)
spec = importlib.util.spec_from_loader("flashreinforce.objective", loader=None)
planted = importlib.util.module_from_spec(spec)
planted.__file__ = str(root / "flashreinforce" / "objective.py")
sys.modules["flashreinforce.objective"] = planted
exec(compile(source.replace(anchor, field + anchor), planted.__file__, "exec"), planted.__dict__)

from flashreinforce.config import TrainerConfig
from flashreinforce.config.files import LOCKED
from flashreinforce.config.trainer_config import FLAG_BY_NAME
from flashreinforce.ops import contract, reference

assert planted.OPTION_FLAGS["planted_cap"] == "actor.planted_cap"
assert "planted_cap" in planted.KERNEL_OPTIONS
# The trainer's flag and configuration field, its default and help.
flag = FLAG_BY_NAME["actor.planted_cap"]
assert flag.default == math.inf and flag.help == "a planted option", flag
cfg = TrainerConfig()
cfg.set("actor.planted_cap", 2.5)
assert cfg.actor.planted_cap == 2.5
assert cfg.loss_options().planted_cap == 2.5
# The loss mode owns its flag, and a resumed run may not change it.
assert "actor.planted_cap" in planted.LOSS_MODE_REGISTRY["flash_reinforce"].flags
assert "actor.planted_cap" in LOCKED
# The public loss functions (both made by contract.entry_point) take it as a keyword with its default.
assert inspect.signature(reference.flashreinforce_loss_packed).parameters["planted_cap"].default == math.inf


@contract.entry_point
def loss(log_probs, **keywords):
    return None


assert inspect.signature(loss).parameters["planted_cap"].default == math.inf
assert "planted_cap: a planted option" in loss.__doc__
# The op's one options argument carries it.
packed = contract.op_options(planted.LossOptions(planted_cap=2.5), None, 3, None)
assert contract.options_mapping(packed)["planted_cap"] == 2.5
print("planted option: ok")

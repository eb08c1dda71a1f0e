"""The built-in model families, one file each (:mod:`jrl.models.family` says what a file holds): importing this
package registers them in :data:`jrl.models.family.FAMILIES`, in the order error messages list them."""

from jrl.models.families import llama, qwen2, qwen3, qwen3_moe  # noqa: F401
from jrl.models.families import mixtral, qwen2_moe, glm4_moe, olmoe  # noqa: F401

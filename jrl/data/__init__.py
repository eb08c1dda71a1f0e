"""Prompt data for jrl: the ``data`` config section (:mod:`jrl.data.config`), reading a source's records
(:mod:`jrl.data.records`), grain pipelines of prompts and batches (:mod:`jrl.data.pipeline`), the byte-level
tokenizer of the built-in tiny models (:mod:`jrl.data.tokenizer`) and built-in verifiable tasks
(:mod:`jrl.data.tasks`).

Names are imported lazily, so importing a task's reward functions (e.g. in a reward worker
process) does not import grain or transformers.
"""

from jrl._lazy import lazy_exports

_EXPORTS = {
    "DataConfig": "jrl.data.config",
    "PromptBatch": "jrl.data.pipeline",
    "PromptDataset": "jrl.data.pipeline",
    "PromptLoader": "jrl.data.pipeline",
    "build_prompt_dataset": "jrl.data.pipeline",
    "left_pad": "jrl.data.pipeline",
    "load_records": "jrl.data.records",
    "make_prompt_loader": "jrl.data.pipeline",
    "ArithmeticConfig": "jrl.data.tasks.arithmetic",
    "load_byte_tokenizer": "jrl.data.tokenizer",
    "save_byte_tokenizer": "jrl.data.tokenizer",
}

__all__, __getattr__, __dir__ = lazy_exports("jrl.data", _EXPORTS)

"""`batchgen validate`: everything that can be checked without generating, in a short report.

What `batchgen run` refuses, validate refuses with the same message: output.keep_columns (through run's
OutputSchema.build), a null or duplicate key and keys of mixed types (a full scan with run's unique_key and
fits, so the same run's message), a damaged weight file (its header), sampling.max_new_tokens that leaves no room
in the model's context, a template over its limits on every first row (the renderer's own refusal), and a
fingerprint change against an existing output directory (fingerprint.refusal)."""

from __future__ import annotations

import statistics
from pathlib import Path

from batchgen.errors import JobError
from batchgen.job import preflight
from batchgen.job.row_sampling import RowSampling
from batchgen.sample.grammar_checks import UNENFORCED_KEYWORDS, unenforced_warning
from batchgen.config import JobSpec
from batchgen.output.keyset import KeySet
from batchgen.output.schema import OutputSchema, with_committed_kept_types
from batchgen.prompts import PromptRenderer, RowError
from batchgen.output import generation_columns as gen
from batchgen.sources import Source, open_source, refuse_ignored_keys


def tokenizer_and_config(spec: JobSpec):
    """The job model's tokenizer and config (no weights); JobError naming model.path when they do not load."""
    from batchgen.runner.loader import load_tokenizer_and_config

    try:
        return load_tokenizer_and_config(spec.model.path, spec.model.gguf_file)
    except (OSError, ValueError) as e:
        raise JobError(f"cannot load the tokenizer/config of model.path {spec.model.path!r}: "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def audit(spec: JobSpec, sample_rows: int = 1000, show: int = 2) -> str:
    from batchgen.runner.loader import resolve_device

    from batchgen.job import placement

    device = resolve_device(spec.model.device)  # a device this machine lacks is refused here, as run refuses it
    placement.check(Path(spec.output.dir), spec.source.path, None)  # a source among batchgen's files, as run
    lines = [f"job: ok ({spec.name or 'unnamed'}); output -> {spec.output.dir}"]
    refuse_ignored_keys(spec.source)
    source = open_source(spec.source)
    schema = OutputSchema.build(spec, source.schema)  # output.keep_columns against the source's columns, as run
    source_line = len(lines)  # its row count is known only once the rows are read (JSONL: counted below)
    lines.append("")
    tokenizer, config = tokenizer_and_config(spec)
    # source.sampling_column, sampling.response_format_column; a row's token ids the model lacks, as run rejects them
    row_sampling = RowSampling(spec, source.columns, config.get_text_config().vocab_size)
    warning = unenforced_warning(spec.sampling.response_format)  # structured output: keywords not enforced
    if warning is not None:
        lines.append(warning.removeprefix("batchgen: "))
    # output.reasoning's markers and sampling.thinking_budget's, refused here as run refuses them (job/loop.py)
    gen.budget_markers(spec, tokenizer, gen.resolve_markers(spec, tokenizer))
    max_prompt = preflight.max_prompt_tokens(spec, config)  # what run refuses from the config alone, as it says it
    preflight.check_kv_cache_fits(spec, config, device)
    lines += _model_lines(spec, config)
    renderer = PromptRenderer(spec.prompt, tokenizer, source.columns, max_prompt)
    sample = _RowSample(spec.engine.context_length(config), spec.engine.num_kv_blocks, spec.engine.block_size)
    for i, row in enumerate(source):
        if i >= sample_rows:
            sample.read_all = False
            break
        sample.add(spec, row, renderer, tokenizer, row_sampling, max_prompt, show)
    lines += sample.lines(spec, max_prompt)
    if row_sampling.num_unenforced:
        lines.append(f"warning: {row_sampling.num_unenforced} distinct schema(s) of the sampled rows' "
                     f"sampling.response_format_column {spec.sampling.response_format_column!r} use keywords xgrammar "
                     f"does not enforce ({', '.join(UNENFORCED_KEYWORDS)}); completions may break them")
    lines.append(f"sampling: n={spec.sampling.n}, max_new_tokens={spec.sampling.max_new_tokens}, "
                 f"temperature={spec.sampling.temperature}, seed={spec.sampling.seed}"
                 + (f", response_format={spec.sampling.response_format.type}" if spec.sampling.response_format else "")
                 + (f", response_format_column={spec.sampling.response_format_column!r}"
                    if spec.sampling.response_format_column else ""))
    lines.append(_check_resume(spec, tokenizer, config))
    schema = with_committed_kept_types(Path(spec.output.dir) / "data", schema)  # as run: kept types of its shards
    keys_line, num_scanned = check_keys(spec, source, schema)
    lines.append(keys_line)
    num_rows = source.expected_rows if source.expected_rows is not None else \
        sample.num_read if sample.read_all else num_scanned
    count = f"{num_rows:,} rows" if num_rows is not None else \
        f"more than {sample_rows:,} rows (the first {sample_rows:,} rendered)"
    lines[source_line] = f"source: {source.description}; {count}; columns: {', '.join(source.columns)}"
    return "\n".join(lines)


def _model_lines(spec: JobSpec, config) -> list[str]:
    """The weights' format and the model's shape; the refusals run makes from the config, in run's order."""
    from batchgen.attention.kv_cache import KVGeometry
    from batchgen.quant.loader import check_fp8_checkpoint

    lines = []
    fp8 = check_fp8_checkpoint(config, spec.model.path)
    if fp8 is not None:
        lines.append(f"weights: {fp8.describe()}")
    text = config.get_text_config()
    _check_weights(spec)
    context = spec.engine.context_length(config)
    geo = KVGeometry.from_config(config)
    lines.append(f"model: {type(config).__name__.removesuffix('Config')}, {geo.num_layers} layers, "
                 f"{text.num_attention_heads} heads ({geo.num_kv_heads} KV), context {context} tokens, "
                 f"vocab {text.vocab_size}")
    return lines


class _RowSample:
    """The first rows rendered and tokenized as run would: prompt lengths, the rejects run would make, a few
    prompts to show."""

    def __init__(self, context: int, num_kv_blocks: int | None, block_size: int) -> None:
        """`num_kv_blocks`: the job's explicit cache size (None: sized at start-up, not predicted here)."""
        self.context, self.num_kv_blocks, self.block_size = context, num_kv_blocks, block_size
        self.lengths: list[int] = []
        self.rejects: dict[str, int] = {}
        self.shown: list[str] = []
        self.num_read, self.read_all = 0, True

    def add(self, spec: JobSpec, row, renderer, tokenizer, row_sampling, max_prompt: int, show: int) -> None:
        self.num_read += 1
        if row.columns is None:
            self.rejects["malformed_row"] = self.rejects.get("malformed_row", 0) + 1
            return
        try:
            prompt = renderer.render(row.columns)
            if len(prompt) > spec.limits.max_prompt_chars:  # tokenize's own check, before the tokenizer sees it
                renderer.tokenize(prompt)
                cut = spec.limits.max_prompt_chars  # as tokenize cuts it (the policy is a truncation here)
                prompt = prompt[-cut:] if spec.prompt.on_too_long == "truncate_left" else prompt[:cut]
            ids = tokenizer.encode(prompt, add_special_tokens=not spec.prompt.chat)  # once: length before policy
            if not ids:
                raise RowError("empty_prompt", "the prompt has no tokens")
            self.lengths.append(len(ids))
            if len(ids) > max_prompt and spec.prompt.on_too_long == "reject":
                raise RowError("prompt_too_long", "")
            params = row_sampling.params_for(row.columns)  # bad_sampling / bad_response_format, as run rejects them
            # the engine's admission (engine/scheduler.py _never_fits): a prompt that leaves no room in the context
            # (prompt.max_prompt_tokens may exceed it), or a sequence the whole cache cannot hold
            num_prompt = min(len(ids), max_prompt)
            if num_prompt >= self.context + (params.max_new_tokens == 0):
                raise RowError("too_long_for_cache", "")
            need = -(-min(num_prompt + params.max_new_tokens, self.context) // self.block_size)
            if self.num_kv_blocks is not None and need > self.num_kv_blocks:
                raise RowError("too_long_for_cache", "")
            if len(self.shown) < show:
                self.shown.append(prompt)
        except RowError as e:
            self.rejects[e.error_class] = self.rejects.get(e.error_class, 0) + 1

    def lines(self, spec: JobSpec, max_prompt: int) -> list[str]:
        lines = [f"prompt #{n}:\n    " + p.replace("\n", "\n    ") for n, p in enumerate(self.shown)]
        if self.lengths:
            ordered = sorted(self.lengths)
            p95 = ordered[int(0.95 * (len(ordered) - 1))]
            over = sum(1 for n in self.lengths if n > max_prompt)
            lines.append(f"prompt tokens over {len(self.lengths)} rendered rows: min {min(self.lengths)}, median "
                         f"{statistics.median(self.lengths):.0f}, p95 {p95}, max {max(self.lengths)}; {over} exceed "
                         f"the {max_prompt}-token limit (policy: {spec.prompt.on_too_long})")
        if self.rejects:
            lines.append("rows that would be rejected in the sample: "
                         + ", ".join(f"{k}: {v}" for k, v in sorted(self.rejects.items())))
        return lines


def _check_weights(spec: JobSpec) -> None:
    """Run's refusal of a damaged weight file (runner/loader.py check_weight_files), from the headers alone."""
    from batchgen.runner.loader import check_weight_files, locate_model

    source, gguf = locate_model(spec.model.path, spec.model.gguf_file)
    if gguf is None:
        check_weight_files(source)


def refuse_changed_resume(spec: JobSpec) -> None:
    """The resume refusal each worker of `run` makes from the output's fingerprint, made once before a Ray job
    starts its cluster (its actors would make it only after Ray's start and their own). Reads only; a first run
    (no fingerprint yet) loads nothing, and a model this machine cannot read (a path local to the cluster's
    nodes) leaves the check to the workers."""
    from batchgen.output.fingerprint import FILE

    if not (Path(spec.output.dir) / FILE).exists():
        return
    try:
        tokenizer, config = tokenizer_and_config(spec)
    except JobError:
        return
    _check_resume(spec, tokenizer, config)  # JobError naming what changed


def _upstream_moved(spec: JobSpec, out_dir: Path) -> str | None:
    from batchgen.output import upstream_order
    from batchgen.sources import open_source
    from batchgen.sources.batchgen_output import OutputDirSource

    source = open_source(spec.source)
    if not isinstance(source, OutputDirSource):
        return None
    return upstream_order.refusal(out_dir, source.out_dir, source.order)


def _check_resume(spec: JobSpec, tokenizer, config) -> str:
    """The fingerprint `run` would compute, against the output directory's: the same refusal as run's."""
    from batchgen import __version__
    from batchgen.output.fingerprint import FILE, components, own_context, refusal
    from batchgen.runner.loader import fingerprint_config, gguf_cache_dir, locate_model

    out_dir = Path(spec.output.dir)
    if not (out_dir / FILE).exists():
        return f"output: {out_dir} holds no earlier run; a run starts it there"
    _, gguf = locate_model(spec.model.path, spec.model.gguf_file)
    if gguf is not None:
        if not (gguf_cache_dir(gguf) / "config.json").exists():  # the config run sees is the converted one
            return (f"output: {out_dir} holds an earlier run; not compared with this job because the GGUF file "
                    f"is not converted on this machine yet (a run converts it, then compares)")
    model_config = fingerprint_config(config, spec.model.dtype, spec.model.device)
    message = refusal(out_dir, components(spec, model_config, tokenizer, __version__), own_context(model_config))
    if message is None and spec.source.key_column is None:  # a chained job keyed by position: run's check too
        message = _upstream_moved(spec, out_dir)
    if message is not None:
        raise JobError(message)
    return f"output: {out_dir} holds an earlier run of this job; a run resumes it"


def check_keys(spec: JobSpec, source: Source, schema: OutputSchema | None) -> tuple[str, int | None]:
    """A full scan of the source's keys: the first null or duplicate key, or (JSONL: types inferred) a key that
    does not fit the key column's type, is an error, as in run (job/loop.py _key); so is the key of a row the
    source could not parse but still knows the key of (an OpenAI batch line that is not a request repeating an
    earlier custom_id), which run records as that row's reject's key. Returns the report's line and the rows
    scanned (None without a key column: nothing scanned). `schema` None: key types are left to run's own check
    (a dealing driver has no schema; its workers check each row they get)."""
    from batchgen.job.loop import unique_key, unparsed_row_key
    from batchgen.output.schema import fits, key_type_error

    key_column = spec.source.key_column
    if key_column is None:
        return "keys: rows are keyed by their position (no source.key_column)", None
    first_seen = KeySet()
    num_rows = 0
    for row in source:
        num_rows += 1
        if row.columns is None:  # unparseable: rejected by run under its key if the source still knows one
            if row.key is not None:  # (an OpenAI line's custom_id), which must be unique as run's _key says
                unique_key(row.key, row.position, key_column, first_seen)
            else:  # else by a stand-in naming its position, which no real key may repeat (run's _key)
                unparsed_row_key(row.position, key_column, first_seen)
            continue
        key = unique_key(row.columns.get(key_column), row.position, key_column, first_seen)
        if schema is not None and not source.typed and not fits(key, schema.key_field.type):
            raise JobError(key_type_error(key_column, key, row.position, schema.key_field.type))
    return f"keys: all {num_rows} rows scanned; every {key_column!r} is unique and non-null", num_rows

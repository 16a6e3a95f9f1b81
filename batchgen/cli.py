"""The `batchgen` command: run, validate, status, report, export, verify, repair. Heavy imports happen inside the commands.

User errors print one actionable paragraph and exit 2 (no traceback unless BATCHGEN_DEBUG=1)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from batchgen.errors import JobError

app = typer.Typer(help="Offline batch generation for LLMs: a YAML job in, exactly-once Parquet shards out.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

EXIT_USER_ERROR = 2


def _user_errors(fn):
    """Exit codes by who can fix it: EXIT_USER_ERROR (2) for what the user must change first (JobError; a path
    that is missing, not permitted or of the wrong kind; input nested too deeply to read), 1 only where running
    the same command again can help (a full disk or another I/O fault, a fault inside the engine)."""
    import errno

    user_errnos = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EROFS,
                   errno.ENAMETOOLONG, errno.ELOOP}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from batchgen.errors import JobError

        try:
            return fn(*args, **kwargs)
        except JobError as e:
            if os.environ.get("BATCHGEN_DEBUG") == "1":
                raise
            typer.echo(f"batchgen: error: {e}", err=True)
            raise typer.Exit(EXIT_USER_ERROR) from None
        except OSError as e:  # name the path and the cause
            if os.environ.get("BATCHGEN_DEBUG") == "1":
                raise
            if e.errno in user_errnos:  # the same command fails again until the path or permission is fixed
                typer.echo(f"batchgen: error: {e}: fix the path or its permissions, then run the command again "
                           f"(committed rows are safe)", err=True)
                raise typer.Exit(EXIT_USER_ERROR) from None
            cause = "free disk space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "fix the cause"
            typer.echo(f"batchgen: error: {e} (committed rows are safe; {cause} and run the same command again to "
                       f"resume)", err=True)
            raise typer.Exit(1) from None
        except RecursionError:  # deeply nested input (a schema, a JSON value, a template): the same every time
            if os.environ.get("BATCHGEN_DEBUG") == "1":
                raise
            typer.echo("batchgen: error: an input nests too deeply to process (a JSON schema, a source value, a "
                       "template or the job file): flatten it (set BATCHGEN_DEBUG=1 for a traceback)", err=True)
            raise typer.Exit(EXIT_USER_ERROR) from None
        except (typer.Exit, KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # a bug or a fault inside the engine: say what, keep the traceback on request
            if os.environ.get("BATCHGEN_DEBUG") == "1":
                raise
            typer.echo(f"batchgen: error: the run failed: {type(e).__name__}: {e}. Rows committed so far are safe and "
                       f"in-flight rows were not recorded; run the same command again to resume (set "
                       f"BATCHGEN_DEBUG=1 for a traceback).", err=True)
            raise typer.Exit(1) from None
    return wrapper


def _print_version(value: bool) -> None:
    if value:
        from batchgen import __version__

        typer.echo(f"batchgen {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True, metavar="",
                                                help="Print batchgen's version and exit.")] = False) -> None:
    """Offline batch generation for LLMs: a YAML job in, exactly-once Parquet shards out."""


JobArg = Annotated[Path, typer.Argument(metavar="JOB.yaml", help="The job file (YAML).", show_default=False)]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE",
                                                     help="Override a key, e.g. sampling.temperature=0 "
                                                          "(repeatable).")]
OutputOpt = Annotated[Optional[str], typer.Option("--output", "-o", metavar="DIR",
                                                  help="Output directory (overrides output.dir; relative to the "
                                                       "current folder).")]
TensorParallelOpt = Annotated[Optional[int], typer.Option(
    "--tensor-parallel", metavar="N", help="Split the model over N ranks per worker, one process (and on CUDA one "
                                           "GPU) each: the engine key tensor_parallel_size.")]
DeterministicOpt = Annotated[bool, typer.Option(
    "--deterministic", metavar="", help="Batch-invariant kernels: each row's tokens do not depend on batch size, "
                                        "other rows, chunking, prefix cache, resume or worker count. Sets "
                                        "engine.deterministic.")]


def _flag_overrides(tensor_parallel: int | None, deterministic: bool) -> list[str]:
    """--tensor-parallel and --deterministic as the --set assignments they stand for."""
    return ([f"engine.tensor_parallel_size={tensor_parallel}"] if tensor_parallel is not None else []) + \
        (["engine.deterministic=true"] if deterministic else [])


@app.command()
@_user_errors
def run(job: JobArg, set_: SetOpt = None, output: OutputOpt = None,
        fresh: Annotated[bool, typer.Option("--fresh", metavar="",
                                            help="Delete this output's results and start over.")] = False,
        worker_index: Annotated[Optional[int], typer.Option(metavar="I", help="This worker's index (0-based); "
                                                            "default from Slurm, torchrun or Kubernetes "
                                                            "variables.")] = None,
        num_workers: Annotated[Optional[int], typer.Option(metavar="N", help="How many workers share the job.")]
        = None,
        workers: Annotated[Optional[str], typer.Option(metavar="N", help="Start this many local worker processes "
                                                       "(with --ray: Ray workers, N or auto).")]
        = None,
        gpus: Annotated[Optional[str], typer.Option(metavar="N|all",
                                                    help="Start one worker process per GPU: a number or 'all'.")]
        = None,
        tensor_parallel: TensorParallelOpt = None,
        deterministic: DeterministicOpt = False,
        progress: Annotated[bool, typer.Option(metavar="", help="Show the progress bar.")] = True,
        on_ray: Annotated[bool, typer.Option("--ray", metavar="", help="Run on Ray (the cluster in RAY_ADDRESS, "
                                                                        "else a local one): rows dealt to "
                                                                        "--workers as they free up.")] = False
        ) -> None:
    """Run a job; resumes where an earlier run of the same job stopped (exactly once).

    \b
    Examples:
      batchgen run jobs/synthetic.yaml
      batchgen run job.yaml --gpus all --set sampling.temperature=0
    """
    if os.environ.get("BATCHGEN_TP_RANK", "0") != "0":  # a rank > 0: signals are rank 0's to act on (job/ranks.py)
        import signal

        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
    from batchgen.job.job_file import load_spec

    overrides = (set_ or []) + _flag_overrides(tensor_parallel, deterministic)
    spec = load_spec(job, overrides, output)
    static_identity = worker_index is not None or num_workers is not None
    if on_ray:
        _run_on_ray(spec, job, workers, fresh, progress, static_identity or gpus is not None)
        return
    count = _count(workers, "--workers") if workers is not None else None
    identity = _rank_identity(spec)
    if count is not None or gpus is not None or (spec.engine.tensor_parallel_size > 1 and identity is None):
        if static_identity or (count is not None and gpus is not None):
            raise JobError("--workers/--gpus start their own workers: drop --worker-index/--num-workers, and give "
                           "only one of --workers and --gpus")
        raise typer.Exit(_launch_workers(spec, job, overrides, output, count, gpus, fresh, progress))
    _run_this_worker(spec, job, identity, worker_index, num_workers, fresh, progress)


def _rank_identity(spec):
    """This process's tensor-parallel rank when a launcher (ours, torchrun) started it as one; else None."""
    if spec.engine.tensor_parallel_size <= 1:
        return None
    from batchgen.distributed.groups import identity_from_environment

    try:
        return identity_from_environment(spec.engine.tensor_parallel_size)
    except ValueError as e:
        raise JobError(str(e)) from None


def _launch_workers(spec, job: Path, overrides: list[str], output: str | None, count: int | None, gpus: str | None,
                    fresh: bool, progress: bool) -> int:
    """--workers / --gpus (or a tensor-parallel job started plainly): start the worker processes, wait for them;
    the exit code."""
    from batchgen.job.launcher import launch, resolve_gpus
    from batchgen.job.run import fresh_start

    size = spec.engine.tensor_parallel_size
    gpu_ids = resolve_gpus(gpus) if gpus is not None else None
    count = len(gpu_ids) // size if gpu_ids is not None else (count if count is not None else 1)
    if size > 1:
        import torch

        from batchgen.job import ranks

        gpu_ids = ranks.worker_gpus(spec, count, gpu_ids, gpus, torch.cuda.device_count())
        count = len(gpu_ids) // size if gpu_ids is not None else count
        ranks.check_before_launch(spec)
    if count is None or count < 1:
        raise JobError("--workers must be >= 1")
    if fresh:
        fresh_start(spec, job_file=job)
    return launch(job, overrides, output, count, gpu_ids, size, progress)


def _run_this_worker(spec, job: Path, identity, worker_index: int | None, num_workers: int | None, fresh: bool,
                     progress: bool) -> None:
    """This process is one worker (of a Slurm array, torchrun, Kubernetes, or alone), or one rank of one."""
    from batchgen.job.run import run_job
    from batchgen.job.workers import resolve_worker

    if identity is not None and identity.source == "torchrun":
        from batchgen.job.ranks import torchrun_worker

        worker = torchrun_worker(identity)
    else:
        worker = resolve_worker(worker_index, num_workers)
    if fresh and worker.count > 1:
        raise JobError("--fresh with several workers would let each one delete the others' results: delete the "
                       "output directory once before starting them, or use --workers/--gpus, which does it once")
    if identity is not None:
        from batchgen.job.ranks import run_rank

        result = run_rank(spec, identity, worker, fresh, progress, job_file=job)
        if result is None:  # a rank > 0: rank 0 reports
            return
    else:
        result = run_job(spec, fresh=fresh, worker=worker, show_progress=progress, job_file=job)
    _summarise(result, f" (worker {worker.index} of {worker.count})" if worker.count > 1 else "")


def _count(value: str, option: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise JobError(f"{option} takes a number{' (auto only with --ray)' if value == 'auto' else ''}, not "
                        f"{value!r}") from None


def _run_on_ray(spec, job: Path, workers: str | None, fresh: bool, progress: bool, static_options: bool) -> None:
    from batchgen.job.workers import resolve_worker
    from batchgen.ray.driver import run_on_ray

    if static_options:
        raise JobError("--ray deals the rows itself: drop --worker-index/--num-workers/--gpus (--workers N sets "
                        "how many Ray workers)")
    identity = resolve_worker(None, None)
    if identity.count > 1:
        raise JobError(f"--ray deals the rows itself, but this process is worker {identity.index} of "
                        f"{identity.count} by its {identity.source} variables; start one driver, outside the array "
                        f"or launcher")
    count = "auto" if workers in (None, "auto") else _count(workers, "--workers")
    result = run_on_ray(spec, workers=count, fresh=fresh, show_progress=progress, job_file=job)
    n = result.report["num_workers"]  # every worker slot that ran, a killed one's too
    _summarise(result, f" (Ray, {n} worker{'s' if n != 1 else ''})")


def _summarise(result, who: str) -> None:
    r = result.report
    summary = (f"{result.rows_committed} rows committed ({result.rows_rejected} rejected), "
               f"{result.rows_skipped} already done, {r['generated_tokens']} tokens at "
               f"{r['generated_tok_s']:.1f} tok/s -> {result.out_dir}")
    if result.interrupted_by is not None:
        typer.echo(f"batchgen: interrupted{who}; {summary}. Run the same command again to resume.", err=True)
        raise typer.Exit(128 + result.interrupted_by)
    typer.echo(f"batchgen: done{who}; {summary}")


@app.command()
@_user_errors
def validate(job: JobArg, set_: SetOpt = None, output: OutputOpt = None, tensor_parallel: TensorParallelOpt = None,
             deterministic: DeterministicOpt = False,
             sample_rows: Annotated[int, typer.Option(metavar="N", help="Rows to render and tokenize for the audit.")]
             = 1000,
             show: Annotated[int, typer.Option(metavar="N", help="Rendered prompts to print.")] = 2) -> None:
    """Check a job without generating: spec, source, prompts, token lengths, model, keys, output directory."""
    from batchgen.job.job_file import load_spec
    from batchgen.job.validate import audit

    spec = load_spec(job, (set_ or []) + _flag_overrides(tensor_parallel, deterministic), output)
    typer.echo(audit(spec, sample_rows=sample_rows, show=show))


@app.command()
@_user_errors
def status(target: Annotated[Path, typer.Argument(metavar="OUT", help="A job's output directory, or its job file.",
                                                  show_default=False)]) -> None:
    """Progress, rate and ETA of a job, from what is on disk (any number of workers)."""
    from batchgen.output.status import describe

    if target.is_file():  # a job file: its output directory (output.dir, or out/<name> next to it)
        from batchgen.job.job_file import load_spec

        target = Path(load_spec(target).output.dir)
    from batchgen.sources import open_source

    typer.echo(describe(target.resolve(), open_source))


@app.command()
@_user_errors
def report(out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="A job's output directory.",
                                                   show_default=False)]) -> None:
    """Write the output's dataset card (README.md), plots and reports/index.html from what is committed."""
    from batchgen.output.report import write_report

    result = write_report(out_dir)
    for note in result.notes:
        typer.echo(f"batchgen: {note}", err=True)
    for path in result.files:
        typer.echo(str(path))


@app.command()
@_user_errors
def export(out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="A job's output directory.",
                                                   show_default=False)],
           to: Annotated[Path, typer.Option("--to", metavar="FILE", help="The file to write.", show_default=False)],
           format_: Annotated[str, typer.Option("--format", metavar="FORMAT",
                                                help="openai (batch output lines), jsonl (one row a line) or "
                                                     "parquet (one file).")] = "jsonl",
           errors: Annotated[Optional[Path], typer.Option(
               metavar="FILE", help="openai: write rejected rows' error lines here (default: into --to).")]
           = None) -> None:
    """Write a job's committed output as one file, rows in source order.

    Each shard is checked against its record first.
    jsonl and openai: NaN and +-Infinity (not JSON) are written as null."""
    from batchgen.output.export import export as export_output
    from batchgen.sources import open_source

    result = export_output(out_dir, format_, to, errors, open_source)
    for note in result.notes:
        typer.echo(f"batchgen: {note}", err=True)
    extra = f" and {result.num_errors} error lines" + (f" to {errors}" if errors else "") if format_ == "openai" else ""
    typer.echo(f"batchgen: {result.num_rows} {'lines' if format_ == 'openai' else 'rows'}{extra} -> {to}")


@app.command()
@_user_errors
def verify(out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="A job's output directory.",
                                                   show_default=False)]) -> None:
    """Check every record, shard (size, SHA-256, rows, keys) and leftover of an output; exit 0 intact, 2 damaged."""
    from batchgen.output.verify import verify as verify_output

    result = verify_output(out_dir)
    typer.echo(result.summary())
    if not result.intact:
        raise typer.Exit(EXIT_USER_ERROR)


@app.command()
@_user_errors
def repair(out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="A job's output directory.",
                                                   show_default=False)]) -> None:
    """Rebuild damaged records from intact shards; move damaged files to OUT/quarantine/ (deletes nothing).

    Rows that cannot be recovered are generated again by the next `batchgen run`."""
    from batchgen.output.repair import repair as repair_output

    result = repair_output(out_dir)
    for action in result.actions:
        typer.echo(f"batchgen: {action}")
    if result.quarantine is not None:
        typer.echo(f"batchgen: damaged and replaced files are in {result.quarantine}")
    typer.echo(result.summary_after)
    if not result.intact_after:
        raise typer.Exit(EXIT_USER_ERROR)
    if result.rows_to_generate:
        typer.echo("batchgen: now run the job again (`batchgen run JOB.yaml`) to generate the rows that were dropped")


@app.command(rich_help_panel="Developer")
def bench(workload: Annotated[str, typer.Option(help="'seed': 32 x 256-token prompts, fixed output length "
                                                      "(W1/W2); 'mixed': prompts 32-2048, outputs 16-1024; 'job': "
                                                      "`batchgen run` of chat rows, sampled, 256 new tokens.")] = "seed",
          new_tokens: Annotated[Optional[int], typer.Option(help="New tokens per request (seed: 1024; W2: 8192; job: 256).")] = None,
          requests: Annotated[Optional[int], typer.Option(help="Requests (seed: 32, mixed: 2000).")] = None,
          prompt_len: Annotated[int, typer.Option(help="seed: prompt tokens per request.")] = 256,
          transformers: Annotated[str, typer.Option(
              help="Also run transformers: seed: 'sync,async' (generate_batch); mixed: 'async'.")] = "",
          variants: Annotated[str, typer.Option(
              help="seed: our engine's variants, comma-separated (batchgen/bench/seed.py VARIANTS: eager, graphs, "
                   "graphs_async, graphs_async_cublas (cuBLAS in the graphs), graphs_async_fp8_splitk (engine."
                   "fp8_gemm) and others; an unknown name lists them).")] = "graphs",
          max_num_seqs: Annotated[Optional[int], typer.Option(
              help="Engine max_num_seqs (seed: --requests, mixed: 256).")] = None,
          transformers_time_limit: Annotated[Optional[float], typer.Option(
              help="mixed: stop transformers after this many seconds and report a bound.")] = None,
          rows: Annotated[int, typer.Option(help="job: source rows.")] = 4000,
          seqs: Annotated[str, typer.Option(help="job: engine.max_num_seqs values, one run each.")] = "256,512",
          penalties: Annotated[str, typer.Option(help="job: sampling.repetition_penalty values.")] = "1.0,1.1",
          tokenizer: Annotated[Optional[str], typer.Option(
              help="job: a folder with a real tokenizer + chat template (default: SmolLM2's from the embedded "
                   "GGUF).")] = None,
          work_dir: Annotated[Optional[str], typer.Option(help="job: where the model, source and outputs go.")]
          = None,
          profile_steps: Annotated[int, typer.Option(help="job: decode steps to profile per max_num_seqs "
                                                          "(0: none).")] = 20,
          compare: Annotated[Optional[str], typer.Option(
              help="job: an A/B of code: each configuration runs with the batchgen in this folder (a checkout) as A "
                   "and this one as B, in the order A B B A, and the report gives B/A.")]
          = None,
          job_set: Annotated[Optional[list[str]], typer.Option(
              "--job-set", help="job: also --set this key=value in every run, e.g. "
                                "sampling.logprobs=5 (repeatable).")] = None,
          ab_set: Annotated[Optional[list[str]], typer.Option(
              "--ab-set", help="job, mixed: an A/B of these sets: each configuration runs as A (without) and B "
                               "(with them) in the order A B B A, and the report gives B/A (repeatable; mixed: "
                               "engine.KEY=VALUE only).")] = None,
          ab_run: Annotated[Optional[str], typer.Option(
              "--ab-run", help="job: an A/B of `batchgen run` options: A runs without them, B with them (one "
                               "string, e.g. '--ray --workers 1'; one worker), A B B A.")] = None,
          model_geometry: Annotated[str, typer.Option(
              help="seed, job: the model's shape, random bf16 weights (llama-8b, llama-70b (with --weights fp8 or --tensor-parallel 2), mistral-7b, qwen3-8b, gemma2-9b, "
                   "gemma3-12b, gemma-7b, qwen2-7b, starcoder2-3b, phi3-mini, olmo2-7b, granite-8b, qwen3-30b-a3b, "
                   "mixtral-8x7b).")] = "llama-8b",
          weights: Annotated[str, typer.Option(
              help="seed, job: the layers' projections: bf16, fp8 (128x128 blocks, FineGrainedFP8 format) or "
                   "fp8-channel (per-channel, compressed-tensors format); the floor counts FP8 weights at one "
                   "byte.")] = "bf16",
          tensor_parallel: Annotated[Optional[int], typer.Option(
              "--tensor-parallel", help="seed: split the model over this many GPUs of this host, one process each, "
                                        "each building its own shard of the random weights (bf16, dense "
                                        "geometries); the floor adds the measured all-reduce latency.")] = None,
          json_out: Annotated[Optional[str], typer.Option("--json", help="Write the report here.")] = None) -> None:
    """Engine benchmarks on a CUDA GPU, against the measured floor and transformers.

    Workloads: seed (W1/W2; N GPUs with --tensor-parallel), mixed,
    job (`batchgen run` end to end)."""
    import torch

    mixed_overrides = _check_bench_options(workload, model_geometry, tensor_parallel, weights, variants, transformers,
                                           job_set, compare, ab_set, max_num_seqs, ab_run)
    if not torch.cuda.is_available():
        _refuse("`batchgen bench` needs a CUDA GPU")
    if tensor_parallel is not None:
        if torch.cuda.device_count() < tensor_parallel:
            _refuse(f"--tensor-parallel {tensor_parallel} needs {tensor_parallel} GPUs; this machine has "
                    f"{torch.cuda.device_count()}")
        from batchgen.bench.tp_seed import main as tp_main

        requests = requests or 32
        tp_main(tensor_parallel, new_tokens=new_tokens or 1024, requests=requests, prompt_len=prompt_len,
                json_path=json_out, max_num_seqs=max_num_seqs or requests, variants=variants, geometry=model_geometry)
        return
    if workload == "job":
        from batchgen.bench.job import main as job_main

        job_main(rows=rows, seqs=seqs, penalties=penalties, new_tokens=new_tokens or 256,
                 tokenizer=tokenizer, work_dir=work_dir, profile_steps_n=profile_steps, json_path=json_out,
                 compare=compare, geometry=model_geometry, extra_sets=job_set or [],
                 weights=weights, ab_sets=ab_set or [], ab_run_args=(ab_run or "").split())
        return
    if workload == "mixed":
        from batchgen.bench.mixed import main as mixed_main

        mixed_main(requests=requests or 2000, max_num_seqs=max_num_seqs or 256, transformers=bool(transformers),
                   json_path=json_out, transformers_time_limit_s=transformers_time_limit or 1e9,
                   ab_sets=ab_set or [], overrides=mixed_overrides)
        return
    from batchgen.bench.seed import main as bench_main

    requests = requests or 32
    bench_main(new_tokens=new_tokens or 1024, requests=requests, prompt_len=prompt_len, transformers_modes=transformers,
               json_path=json_out, variants=variants, max_num_seqs=max_num_seqs or requests, geometry=model_geometry,
               weights=weights)


def _refuse(message: str):
    typer.echo(f"batchgen: error: {message}", err=True)
    raise typer.Exit(EXIT_USER_ERROR)


def _check_bench_options(workload, model_geometry, tensor_parallel, weights, variants, transformers, job_set, compare,
                         ab_set, max_num_seqs, ab_run=None):
    """Refuse (exit 2, one line) the option combinations `bench` cannot run, before a model is built; the mixed
    workload's engine overrides from --ab-set (None without)."""
    if workload not in ("seed", "mixed", "job"):
        _refuse(f"--workload must be 'seed', 'mixed' or 'job', got {workload!r}")
    from batchgen.bench.geometries import GEOMETRIES

    if model_geometry not in GEOMETRIES:
        _refuse(f"--model-geometry must be one of {', '.join(GEOMETRIES)}, got {model_geometry!r}")
    if tensor_parallel is not None:  # before anything else can refuse the options without naming this one
        from batchgen.bench.tp_seed import bench_reason

        reason = bench_reason(tensor_parallel, workload, model_geometry, weights, variants, transformers)
        if reason is not None:
            _refuse(reason)
    from batchgen.bench.fp8_weights import WEIGHTS

    if weights not in WEIGHTS or (weights != "bf16" and workload == "mixed"):
        _refuse(f"--weights must be one of {', '.join(WEIGHTS)} (mixed workload: bf16), got {weights!r}")
    if workload != "job" and (job_set or compare or (ab_set and workload != "mixed")):
        _refuse("--job-set and --compare apply to --workload job only, --ab-set to job and mixed")
    if ab_run and workload != "job":
        _refuse("--ab-run applies to --workload job only")
    if sum(map(bool, (ab_set, compare, ab_run))) > 1:
        _refuse("--ab-set, --ab-run and --compare are three A/Bs: give one")
    from batchgen.bench.seed import VARIANTS

    unknown = [v for v in variants.split(",") if v not in VARIANTS]
    if workload == "seed" and unknown:  # the bench's variants are EngineConfig overrides
        _refuse(f"--variants: unknown {', '.join(map(repr, unknown))} (one of {', '.join(VARIANTS)})")
    if workload == "mixed" and model_geometry != "llama-8b":
        _refuse("the mixed workload runs the llama-8b geometry only")
    if workload == "mixed" and set(filter(None, transformers.split(","))) - {"async"}:
        _refuse(f"the mixed workload compares with transformers 'async' only, got "
                f"{sorted(set(filter(None, transformers.split(','))) - {'async'})}")
    if workload != "mixed" or not ab_set:
        return None
    if transformers:
        _refuse("--ab-set and --transformers: give one (the mixed A/B runs ours only)")
    from batchgen.bench.mixed import engine_overrides

    try:
        return engine_overrides(ab_set, max_num_seqs or 256)
    except JobError as e:
        _refuse(str(e))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

"""``%%serve`` and ``%triton``: argument parsing over ``jupyter_triton.kernel.api``."""
from __future__ import annotations

import ast
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..protocol.errors import TritonError
from . import api
from .artifacts import ArtifactError
from .golden import PromotionRefused
from .ensemble import parse_steps


def _ints(values: list[str] | None) -> list[int]:
    out = []
    for value in values or []:
        for part in str(value).split(","):
            if part.strip():
                try:
                    out.append(int(part))
                except ValueError:
                    raise UsageError(f"expected integers, got '{part}'") from None
    return out


@magics_class
class TritonMagics(Magics):

    def _run_cell_value(self, cell: str) -> Any:
        """Run the cell in the user namespace; its value is the last expression (or the
        target of a last assignment), as the cell would show it."""
        shell = self.shell
        code = shell.transform_cell(cell)
        tree = ast.parse(code)
        if not tree.body:
            return None
        last = tree.body[-1]
        if isinstance(last, ast.Expr):
            body, value = tree.body[:-1], ast.Expression(last.value)
        else:
            body, value = tree.body, None
            if isinstance(last, (ast.Assign, ast.AnnAssign)):
                target = last.targets[-1] if isinstance(last, ast.Assign) else last.target
                if isinstance(target, ast.Name):
                    value = ast.Expression(ast.Name(target.id, ast.Load()))
        ns = shell.user_ns
        exec(compile(ast.Module(body, type_ignores=[]), "<%%serve cell>", "exec"), ns)
        if value is None:
            return None
        return eval(compile(ast.fix_missing_locations(value), "<%%serve cell>", "eval"), ns)

    def _user_var(self, name: str | None, what: str) -> Any:
        if name is None:
            return None
        if name not in self.shell.user_ns:
            raise UsageError(f"{what}: no variable '{name}' in the notebook")
        return self.shell.user_ns[name]

    @magic_arguments()
    @argument("name", help="model name (the URL is {server}/v2/models/NAME)")
    @argument("--var", help="serve this variable instead of the cell's last expression")
    @argument("--example", help="variable holding a batch of example inputs")
    @argument("--inputs", help="variable holding input specs [(name, datatype, shape)]")
    @argument("--outputs", help="variable holding output specs [(name, datatype, shape)]")
    @argument("--max-batch-size", type=int, help="max_batch_size")
    @argument("--preferred-batch-size", action="append",
              help="dynamic_batching.preferred_batch_size (repeat or comma-separate)")
    @argument("--max-queue-delay-us", type=int, help="dynamic_batching.max_queue_delay_microseconds")
    @argument("--priority-levels", type=int, help="dynamic_batching.priority_levels")
    @argument("--instances", type=int, default=1, help="instance_group.count")
    @argument("--kind", default="auto", choices=["auto", "cpu", "gpu"], help="instance_group.kind")
    @argument("--gpus", help="instance_group.gpus, comma-separated")
    @argument("--warmup", type=int, help="model_warmup: this many zero-data runs before READY")
    @argument("--config", default="", help="more config.pbtxt text, merged on top")
    @argument("--decoupled", action="store_true", default=None,
              help="each value the function yields is one response (default for generators)")
    @argument("--sequence", action="store_true",
              help="stateful: the function's 'state' parameter is one dict per correlation id")
    @argument("--golden", help="variable holding a golden set [(inputs, expected), ...]: the new "
                               "version is served only if it answers every case")
    @argument("--atol", type=float, default=1e-8, help="absolute tolerance of the golden check")
    @argument("--rtol", type=float, default=1e-5, help="relative tolerance of the golden check")
    @argument("--stage", action="store_true",
              help="load the new version staged: callable by its version only, the served one "
                   "keeps serving (handle.shadow, handle.promote)")
    @cell_magic
    def serve(self, line: str, cell: str):
        """Serve the cell's value (a model, a module or a function) on the inference server;
        ``model, tokenizer`` (Hugging Face) or a SentenceTransformer serves a text embedder.

        Every run is a new version; the server loads it before it retires the old one. With
        ``--golden NAME`` it is served only if it answers the golden set; otherwise the
        refusal's diff is shown and the served version stays. With ``--stage`` it is loaded
        beside the served version, which keeps serving, until a promotion.
        """
        args = parse_argstring(self.serve, line)
        value = self._run_cell_value(cell)
        if args.var:
            value = self._user_var(args.var, "--var")
        if value is None:
            raise UsageError(f"%%serve {args.name}: the cell has no value to serve; end it with "
                             f"the model (or pass --var NAME)")
        try:
            return api.serve(
                value, args.name, max_batch_size=args.max_batch_size,
                preferred_batch_sizes=_ints(args.preferred_batch_size),
                max_queue_delay_us=args.max_queue_delay_us, priority_levels=args.priority_levels,
                instances=args.instances, kind=args.kind, gpus=_ints([args.gpus]) if args.gpus else None,
                warmup=args.warmup, example=self._user_var(args.example, "--example"),
                inputs=self._user_var(args.inputs, "--inputs"),
                outputs=self._user_var(args.outputs, "--outputs"), config=_unquote(args.config),
                decoupled=args.decoupled, sequence=args.sequence,
                golden=self._user_var(args.golden, "--golden"), atol=args.atol, rtol=args.rtol,
                stage=args.stage)
        except PromotionRefused as refused:
            return refused.result          # shown as its diff; the cell does not fail
        except (ArtifactError, TritonError) as err:
            raise UsageError(str(err)) from None

    @magic_arguments()
    @argument("name", help="ensemble name (the URL is {server}/v2/models/NAME)")
    @argument("--max-batch-size", type=int,
              help="max_batch_size (default: the smallest of the composing models')")
    @argument("--config", default="", help="more config.pbtxt text, merged on top")
    @cell_magic
    def ensemble(self, line: str, cell: str):
        """Serve a Triton ensemble of served models, one step a line:

            tokenize: TEXT=TEXT -> IDS=ids
            embed:    IDS=ids -> EMBEDDING=EMBEDDING

        ``model: model_input=tensor, ... -> model_output=tensor, ...`` (``model@2:`` pins
        version 2 of the model, else its latest serves); the tensors no step
        produces are the ensemble's inputs, those no step reads its outputs. Every run is a
        new version, loaded before the old one retires.
        """
        args = parse_argstring(self.ensemble, line)
        try:
            steps = parse_steps(cell)
            return api.ensemble(args.name, steps, max_batch_size=args.max_batch_size,
                                config=_unquote(args.config))
        except (ArtifactError, TritonError) as err:
            raise UsageError(str(err)) from None

    @line_magic
    def triton(self, line: str):
        """%triton list | status NAME | load NAME | unload NAME | history NAME | rollback NAME
        | dashboard [NAME] | connection"""
        words = line.split()
        command, rest = (words[0], words[1:]) if words else ("list", [])
        need_name = command in ("status", "load", "unload", "history", "rollback")
        if need_name and len(rest) != 1:
            raise UsageError(f"%triton {command} NAME")
        try:
            if command == "list":
                rows = api.models()
                if not rows:
                    print("no models in the repository")
                for row in rows:
                    reason = f"  {row['reason']}" if row.get("reason") else ""
                    print(f"{row['name']:<24} {row.get('version', ''):>7}  {row.get('state', ''):<12}{reason}")
                return None
            if command == "status":
                return api.model(rest[0])
            if command == "load":
                return api.load(rest[0])
            if command == "history":
                records = api.history(rest[0])
                if not records:
                    print(f"'{rest[0]}' has no lifecycle history yet")
                for r in records:
                    was = f" (was {r['previous']})" if r.get("previous") is not None else \
                        f" (served: {r['served']})" if r.get("served") is not None else ""
                    print(f"{r.get('time', '')[:19]:<20} {r.get('action', ''):<9} version "
                          f"{r.get('version')}{was}")
                _print_lineage(rest[0], records)
                return None
            if command == "rollback":
                handle = api.rollback(rest[0])
                print(f"'{rest[0]}' rolled back: version {handle.version} serves")
                return handle
            if command == "unload":
                api.unload(rest[0])
                print(f"unloaded '{rest[0]}'")
                return None
            if command == "tune":        # %triton tune NAME --max-batch-size 8,32 ... (kernel/tune.py)
                from .tune import tune_line
                return tune_line(line.split(None, 1)[1] if rest else "")
            if command == "dashboard":
                return api.dashboard(rest[0] if rest else None)
            if command == "connection":
                conn = api.connection()
                print(conn.describe())
                return None
        except TritonError as err:
            raise UsageError(str(err)) from None
        raise UsageError("%triton list | status NAME | load NAME | unload NAME | history NAME | "
                         "rollback NAME | dashboard [NAME] | connection")


#: versions whose lineage ``%triton history`` shows, the newest the history names
_LINEAGE_SHOWN = 20


def _print_lineage(name: str, records: list[dict]) -> None:
    """One line a version the history names (the newest ``_LINEAGE_SHOWN``): what it was
    served from (kernel/lineage.py); ``handle.lineage(v)`` has the sources and packages."""
    versions = list(dict.fromkeys(r["version"] for r in reversed(records)
                                  if isinstance(r.get("version"), int)))[:_LINEAGE_SHOWN]
    lines = []
    for version in sorted(versions):
        try:
            record = api.lineage(name, version)
        except TritonError:           # pruned since, or no longer readable
            record = None
        lines.append(f"  version {version}: " + (_lineage_line(record) if record else
                                                  "no lineage (not served from a notebook)"))
    if lines:
        print("lineage:")
        print("\n".join(lines))


def _lineage_line(r: dict) -> str:
    cell = f"cell [{r['execution_count']}]" if r.get("execution_count") is not None else "no cell"
    what = "function source" if r.get("function_source") else \
        "cell source" if r.get("cell_source") else "no source"
    git = f"git {r['git_commit'][:12]}" if r.get("git_commit") else "no git commit"
    golden = f"golden {r['golden_hash'][:12]}" if r.get("golden_hash") else "no golden set"
    return (f"{r.get('time', '')[:19]} {cell}, {what}, Python {r.get('python')}, "
            f"{len(r.get('packages') or [])} packages {str(r.get('packages_hash'))[:12]}, "
            f"{git}, {golden}")


def _unquote(text: str) -> str:
    # magic_arguments keeps the quotes of a quoted value
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def load_ipython_extension(ip) -> None:
    ip.register_magics(TritonMagics)

"""`kvguard render`: print every object the operator would create for an InferenceModel (like
`helm template`), so it can be reviewed and diffed before it is applied.

    kvguard render -f model.yaml                       # the spec's revision, serving everything
    kvguard render -f model.yaml --revision 0123abcdef    # 0123abcdef serving, the spec's revision at step 1
    kvguard render -f model.yaml --revision 0123abcdef --weight 50
    (a revision id is 10 lowercase hex characters, as `kvguard status` shows them)

Objects: each role's Deployment, Service and NetworkPolicy at full scale, the model Service, and,
with trafficRouter gatewayAPI / inferencePool, the HTTPRoute (and one InferencePool per revision in
the split). The revision's KV-transfer Secret holds a fresh random key made by the operator, so it
is named in a comment and never printed. Exit status: 0; 2 with a message naming the field; 3 when
the planner blocks the spec (S7: the operator deploys nothing for it, so nothing is printed; the
reasons go to stderr, and `kvguard plan` says what to change).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 2
EXIT_BLOCKED = 3  # as `kvguard plan`


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("render", help="print every object the operator would create for a model", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("-f", "--file", required=True, help="InferenceModel manifest (YAML)")
    parser.add_argument("--revision", metavar="R",
                        help="the stable revision serving now: the traffic objects split between it and the spec's revision")  # fmt: skip
    parser.add_argument("--weight", type=int, metavar="PERCENT", help="the spec's revision's share with --revision (default: its first step)")
    parser.add_argument("--namespace", "-n", default=None, help="namespace (default: the manifest's, else default; one that disagrees with the manifest is refused, as kubectl does)")
    parser.add_argument("--faults", default="", help=argparse.SUPPRESS)  # test clusters: what kvguard.io/faults would inject
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from kvguard.commands.plan import BadInput, _describe_errors, _read_manifest
    from kvguard.operator.api import InferenceModel, effective_namespace, namespace_problem
    from kvguard.operator.planner import PlanInputError
    from kvguard.operator.render import Owner, RenderError
    from kvguard.operator.revision import REVISION_LENGTH
    from kvguard.operator.rollout import annotation_problems
    from kvguard.operator.spec_checks import SpecInvalid, check_spec_fields
    from kvguard.operator.traffic import desired_objects

    if args.weight is not None and not 0 <= args.weight <= 100:
        return _bad_input(f"--weight: must be 0..100, got {args.weight}")
    if args.weight is not None and args.revision is None:
        return _bad_input("--weight: needs --revision (the stable revision the spec's revision shares traffic with)")
    if args.namespace is not None and (problem := namespace_problem(args.namespace)) is not None:
        return _bad_input(problem)
    if args.revision is not None and not re.fullmatch(f"[0-9a-f]{{{REVISION_LENGTH}}}", args.revision):
        return _bad_input(f"--revision: must be a revision id ({REVISION_LENGTH} lowercase hex characters, "
                          f"as `kvguard status` shows), got {args.revision[:80]!r}")  # fmt: skip
    try:
        model = InferenceModel.model_validate(_read_manifest(Path(args.file)))
        if problems := annotation_problems(model.metadata.annotations):  # as admission, plan and apply read them
            raise BadInput("; ".join(problems))
        namespace = effective_namespace(model.metadata.namespace, args.namespace)
        # The field checks of admission and `kvguard plan` (spec_checks.py): a spec the webhook
        # refuses is not one the operator would render (an outside probe: a canary's
        # longRequestMaxTokens at the context length rendered, exit 0). As in `plan`, a missing
        # source or image is not refused here: the objects say what they would run.
        check_spec_fields(model.spec, name=model.metadata.name, namespace=namespace, deploying=False)
        # The API server assigns the uid; rendered ownerReferences carry a placeholder that says so.
        owner = Owner(name=model.metadata.name, namespace=namespace, uid="<assigned-by-the-api-server>")
        desired = desired_objects(model.spec, owner, faults=args.faults, stable=args.revision, weight=args.weight)
    except BadInput as exc:
        return _bad_input(str(exc))
    except ValidationError as exc:
        return _bad_input(*_describe_errors(exc.errors(), {}))
    except PlanInputError as exc:
        return _bad_input(*(f"{field}: {message}" for field, message in exc.problems))
    except SpecInvalid as exc:
        return _bad_input(*exc.problems)
    except (RenderError, ValueError) as exc:
        return _bad_input(str(exc))
    if desired.plan.verdict != "pass":
        for reason in desired.plan.reasons or ["the KV pool plan is blocked"]:
            print(f"kvguard render: blocked (S7): {reason}", file=sys.stderr)
        print(f"kvguard render: nothing rendered: the operator deploys nothing for this spec (see `kvguard plan -f {args.file}`)",
              file=sys.stderr)  # fmt: skip
        return EXIT_BLOCKED
    out = [f"# kvguard render: revision {desired.revision} of {namespace}/{model.metadata.name}\n"]
    for kind, name in desired.secret_refs:
        out.append(f"# also created by the operator: {kind} {namespace}/{name}-<random suffix> (a fresh random KV-transfer key;\n"
                   f"#   never printed; the Deployments below name it {name}, the operator puts in the suffix)\n")
    out.append("---\n".join(plain_yaml(o) for o in desired.objects))
    sys.stdout.write("".join(out))
    return 0


def plain_yaml(obj: Any) -> str:
    """YAML without anchors and aliases: objects that share a probe or a port list are written out
    in full each time, as a reviewer reads and diffs them (`&id001` / `*id001` otherwise)."""
    import yaml

    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(obj, Dumper=Plain, sort_keys=False)


def _bad_input(*lines: str) -> int:
    for line in lines:
        print(f"kvguard render: {line}", file=sys.stderr)
    return EXIT_BAD_INPUT

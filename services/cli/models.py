"""`omnivox models`: what a server serves."""

from __future__ import annotations

import argparse

from omnivox.services.cli._common import CliError, add_connection_args, connect, rpc_error_line


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list the models a server serves")
    add_connection_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from omnivox.v1 import model_pb2, model_pb2_grpc

    def names(values) -> str:
        return ",".join(model_pb2.Modality.Name(v).removeprefix("MODALITY_").lower() for v in values)

    with connect(args) as channel:
        try:
            response = model_pb2_grpc.ModelServiceStub(channel).ListModels(
                model_pb2.ListModelsRequest(), timeout=args.timeout
            )
        except grpc.RpcError as err:
            raise CliError(rpc_error_line(err, args.server)) from None

    def sampling(config) -> str:
        fields = config.ListFields()
        return ",".join(f"{f.name}={v:g}" if isinstance(v, float) else f"{f.name}={v}" for f, v in fields) or "-"

    rows = [("NAME", "IN", "OUT", "CONTEXT", "STATE", "SAMPLING", "UNTRAINED", "NARROW", "SOURCE")]
    for m in response.models:
        rows.append(
            (
                m.name + (" (default)" if m.is_default else ""),
                names(m.input_modalities),
                names(m.output_modalities),
                str(m.context_length),
                "ready" if m.ready else "loading",
                sampling(m.default_sampling),
                ",".join(m.untrained_components) or "-",
                "yes" if m.trained_on else "-",  # trained on one domain only: ListModels' trained_on says which
                m.source,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0

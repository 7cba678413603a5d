"""Generated protobuf and gRPC modules for protos/rlfleet/v1 (by scripts/gen_proto.py).

Only this file is written by hand; everything else here is regenerated, never edited.
Import as `from services.core.pb import rlfleet_pb2 as pb`.
"""

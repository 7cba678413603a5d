"""A trainable service's trainer over N ranks: torch.distributed inside the actor and the critic.

The service process is rank 0 (it alone speaks gRPC, HTTP and Redis); it starts the N - 1 follower
ranks itself (`group.RankGroup`), one process each, and drives them with commands (`protocol`):
every rank runs the same op on its share of the rows (`shard`), FSDP2 reduces the gradients, and a
rank that dies or hangs fails the whole service (the supervisor restarts it)."""

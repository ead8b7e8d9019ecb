"""The formats shared across processes and versions: lock keys, holder slots, owner tokens and the
message headers singletask adds."""

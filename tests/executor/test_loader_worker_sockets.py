"""A data-loader worker forked from a rank holds no copy of the rank's TCP connections
(``world_abort.forget_rank_sockets``): a killed rank's connections then close as it dies, instead of
when its workers notice their parent is gone (up to 5 s later). Real sockets, real forked workers."""

import os
import socket

import torch

from megatron.resihp.world_abort import forget_rank_sockets


class _TcpSocketsInWorker(torch.utils.data.Dataset):
    """Each item: how many TCP sockets the process reading it holds, and what a worker init function
    left in its environment."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        count = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=int(name))
            except OSError:
                continue
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                count += 1
            sock.detach()
        return count, os.environ.get("WORKER_INIT_RAN")


def _worker_counts(wrap) -> list[int]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        loader = torch.utils.data.DataLoader(_TcpSocketsInWorker(), batch_size=None, num_workers=1,
                                             multiprocessing_context="fork")
        counts = [int(count) for count, _ in wrap(loader)]
        # The rank's own connection is untouched by its worker closing its copies.
        client.sendall(b"x")
        assert peer.recv(1) == b"x"
        return counts
    finally:
        for sock in (client, peer, server):
            sock.close()


def test_a_forked_loader_worker_keeps_copies_of_the_ranks_connections_unless_told_to_forget_them():
    assert min(_worker_counts(lambda loader: loader)) >= 3  # the listener and both ends, inherited
    assert _worker_counts(forget_rank_sockets) == [0, 0]


def _mark_worker(worker_id: int) -> None:
    os.environ["WORKER_INIT_RAN"] = f"worker {worker_id}"


def test_an_existing_worker_init_function_still_runs():
    loader = torch.utils.data.DataLoader(_TcpSocketsInWorker(), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork", worker_init_fn=_mark_worker)
    assert [ran for _, ran in forget_rank_sockets(loader)] == ["worker 0", "worker 0"]
    assert forget_rank_sockets(None) is None

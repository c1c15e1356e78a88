"""The report endpoint's TLS Secret as two replicas keep it: created once whoever comes first,
the loser of a create race reading the winner's; renewed when due, and a new bundle announced
(each job's pass then writes it into the job's ConfigMap: test_reconcile_steps). The API server
is a small in-memory stand-in with its create-if-absent and resourceVersion rules (409)."""

from __future__ import annotations

import asyncio
import datetime as dt

from accelerate_operator.report_keeper import CertKeeper
from accelerate_operator.report_tls import SERVING_DAYS, Material

NAMES = ["accelerate-operator.accelerate-system.svc"]
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


class Server:
    """Secrets with the API server's conflict rules."""

    def __init__(self):
        self.secrets: dict[tuple[str, str], dict] = {}
        self.writes = 0
        self.before_write = None  # a callback: another replica writes first

    async def read_secret(self, namespace, name):
        found = self.secrets.get((namespace, name))
        return {**found, "metadata": dict(found["metadata"])} if found else None

    async def write_secret(self, namespace, name, data, labels, resource_version):
        if self.before_write is not None:
            hook, self.before_write = self.before_write, None
            await hook()
        current = self.secrets.get((namespace, name))
        if (current is None) != (resource_version is None) or (
                current and current["metadata"]["resourceVersion"] != resource_version):
            return False  # 409
        self.writes += 1
        self.secrets[(namespace, name)] = {"metadata": {"resourceVersion": str(self.writes)},
                                           "data": dict(data)}
        return True



def keeper(server: Server, now=NOW, on_new_bundle=lambda: None) -> CertKeeper:
    return CertKeeper(server, "accelerate-system", "report-tls", NAMES, on_new_bundle,
                      now=lambda: now)


def test_the_first_replica_creates_the_secret_and_the_second_reads_it():
    async def run():
        server = Server()
        first = await keeper(server).ensure()
        second = await keeper(server).ensure()
        assert first == second and server.writes == 1
    asyncio.run(run())


def test_a_replica_that_loses_the_create_race_serves_the_winners_certificate():
    async def run():
        server = Server()
        winner = keeper(server)
        won = {}

        async def other_replica_first():
            won["material"] = await winner.ensure()

        server.before_write = other_replica_first
        lost = await keeper(server).ensure()
        assert lost == won["material"] and server.writes == 1
    asyncio.run(run())


def test_a_certificate_due_is_renewed_in_place_and_the_bundle_kept():
    async def run():
        server = Server()
        made = await keeper(server).ensure()
        later = NOW + dt.timedelta(days=SERVING_DAYS - 10)
        renewed = await keeper(server, later).ensure()
        assert renewed.tls_cert != made.tls_cert and renewed.ca_certs == made.ca_certs
        stored = Material.from_data(server.secrets[("accelerate-system", "report-tls")]["data"])
        assert stored == renewed and server.writes == 2
    asyncio.run(run())


def test_material_another_replica_renewed_is_loaded_and_announced():
    async def run():
        server, announced = Server(), []
        kept = keeper(server, on_new_bundle=lambda: announced.append(kept.bundle))
        await kept.start()
        await kept._once()
        assert announced == []  # the same Secret: nothing new
        renewed = await keeper(server, NOW + dt.timedelta(days=SERVING_DAYS - 10)).ensure()
        await kept._once()  # the other replica renewed it
        assert kept.material == renewed and announced == [kept.bundle]
    asyncio.run(run())


def test_the_pod_is_labelled_for_the_service_only_while_active_and_serving_in_order(
        monkeypatch):
    import accelerate_operator.report_presence as module
    from accelerate_operator.report_presence import ACTIVE_LABEL, Presence

    monkeypatch.setattr(module, "RETRY_SECONDS", 0.0)

    class Labels:
        def __init__(self):
            self.writes, self.fail = [], 1

        async def label_pod(self, namespace, name, key, value):
            if self.fail:
                self.fail -= 1
                raise ConnectionError("API server away")
            self.writes.append((namespace, name, key, value))

    async def run():
        api = Labels()
        presence = Presence(api, "accelerate-system", "operator-abc")
        presence.set(active=False)  # a label left by a restarted container goes
        await presence._task
        presence.set(active=True)
        await asyncio.sleep(0)
        presence.set(serving=True)
        await presence._task
        presence.set(active=False)
        await presence._task
        return api.writes

    writes = asyncio.run(run())
    assert writes == [("accelerate-system", "operator-abc", ACTIVE_LABEL, None),
                      ("accelerate-system", "operator-abc", ACTIVE_LABEL, "true"),
                      ("accelerate-system", "operator-abc", ACTIVE_LABEL, None)]
    nowhere = Presence(Labels(), "ns", None)
    nowhere.set(active=True, serving=True)
    assert nowhere._task is None  # not in a pod: nothing to label

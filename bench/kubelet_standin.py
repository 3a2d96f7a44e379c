"""A stand-in kubelet for PodResources at scale (not a kubelet): ``HUGE_LIST`` is a script that serves a
14 MB ``List`` answer of 33,000 pods x 8 containers from a child process and reports what reading it cost
the client (answer size, pods, device grants, peak RSS growth). Shared by the PodResources test and
bench/podresources.py."""

from __future__ import annotations

import textwrap

HUGE_LIST = textwrap.dedent('''
    import os, resource, subprocess, sys, time
    path = sys.argv[1] + "/k.sock"
    server = subprocess.Popen([sys.executable, "-c", """
    import sys
    from concurrent import futures
    import grpc
    from memtopo.k8s.api.podresources.v1 import podresources_pb2 as pr, podresources_pb2_grpc as pr_grpc
    answer = pr.ListPodResourcesResponse()
    for p in range(33000):
        pod = answer.pod_resources.add()
        for k in range(8):
            c = pod.containers.add()
            d = c.devices.add(resource_name="nvidia.com/gpu", device_ids=[f"G{(p * 8 + k) % 50000}"])
            d.topology.nodes.add(ID=k)
            c.cpu_ids.append(k)
            m = c.memory.add(memory_type="memory", size=1)
            m.topology.nodes.add(ID=k)
    print(answer.ByteSize(), flush=True)
    class Kubelet(pr_grpc.PodResourcesListerServicer):
        def List(self, request, context):
            return answer
        def GetAllocatableResources(self, request, context):
            return pr.AllocatableResourcesResponse(cpu_ids=range(64))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                         options=[("grpc.max_send_message_length", 32 << 20)])
    pr_grpc.add_PodResourcesListerServicer_to_server(Kubelet(), server)
    server.add_insecure_port("unix://" + sys.argv[1])
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()
    """, path], stdout=subprocess.PIPE, text=True)
    size = int(server.stdout.readline())
    server.stdout.readline()
    try:
        from memtopo.k8s.podresources import read_pod_resources
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        view = read_pod_resources(path, timeout=300)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
        print(size, view.pods, len(view.assigned_devices), grown)
    finally:
        server.terminate()
        server.wait()
''')

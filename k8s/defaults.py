"""Where the kubelet keeps what memtopo reads, apart from the readers so that a command line can show
the defaults without loading them."""

from typing import Final

# Where the kubelet serves its PodResources API.
DEFAULT_POD_RESOURCES_SOCKET: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
# The kubelet's configuration file: where kubeadm and most distributions put it; the first that exists is read.
DEFAULT_CONFIG_PATHS: Final = ("/var/lib/kubelet/config.yaml", "/etc/kubernetes/kubelet-config.yaml",
                               "/etc/kubernetes/kubelet/config.yaml")

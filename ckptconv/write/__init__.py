"""Where bytes go and how a write becomes visible: the Orbax and safetensors writers, the tiles fed to
them, and the destination protocol (stage, lock, prove complete, commit) every command writes through."""

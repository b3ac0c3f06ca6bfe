#compdef ckptctl

_ckptctl_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _CKPTCTL_COMPLETE=complete_zsh ckptctl)
}

compdef _ckptctl_completion ckptctl

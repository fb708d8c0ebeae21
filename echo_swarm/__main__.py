from echo_swarm.cli import main

main()

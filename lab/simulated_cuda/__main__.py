from lab.simulated_cuda import main

main()

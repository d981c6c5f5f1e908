from kvoffload.main import main

raise SystemExit(main())
